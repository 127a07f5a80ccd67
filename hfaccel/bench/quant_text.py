"""The fixed text `bench/quant.py` measures perplexity on: plain expository English, written for this
bench (no dataset download), about 450 SmolLM2 tokens."""

PERPLEXITY_TEXT = """\
The town stood where the river bends twice before it reaches the sea. In the morning the fishing boats
left the harbour one after another, and by noon the market square was full of people buying bread,
vegetables and fish. The baker opened his shop before sunrise, because the workers at the mill wanted
warm bread on their way to work. His daughter kept the accounts in a small blue notebook, writing down
every sale in careful handwriting.

Most of the houses were built of grey stone, with red roofs and narrow windows that kept out the wind
in winter. In summer the streets smelled of salt and flowers. Children played by the old bridge, and
their parents warned them every day not to climb on the railings. Nobody remembered who had built the
bridge, but everyone agreed that it was older than the church.

A library was opened in the former post office ten years ago. It has three rooms: one for children,
one for newspapers and one for books about the history of the region. The librarian, a patient man
who had taught mathematics for thirty years, likes to explain how the tides work. Twice a day the sea
rises and falls, he says, because the moon and the sun pull on the water, and the shape of the coast
decides how high the water climbs.

Every autumn the town holds a festival. Farmers bring apples, pears and honey, musicians play in the
square until late in the evening, and the school organises a race along the river. Visitors come from
the nearby villages, and the small hotel near the station is fully booked for the whole week. When the
festival ends, the streets become quiet again, and the town returns to its slow and regular rhythm.

Scientists who study coastal towns say that places like this one face difficult questions. Rising sea
levels threaten the lowest streets, young people move to the cities to find work, and the fishing
industry employs fewer people every year. Still, many residents believe that the town will adapt, as
it has done for centuries, by building new walls, welcoming new families and finding new ways to earn
a living from the sea.
"""
