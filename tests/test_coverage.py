"""The coverage table of HF generate options (hfaccel/bench/coverage.py) runs and classifies them."""

from hfaccel.bench import coverage
from hfaccel.cli import build_parser


def test_coverage_classifies_known_options(tmp_path):
    report = coverage.run_coverage(str(tmp_path), plot=False, verbose=False)
    status = {r.option.name: r for r in report["results"]}
    assert status["max_new_tokens"].status == coverage.SERVED  # greedy, the engine's own case
    assert status["do_sample"].status == coverage.SERVED
    assert status["negative_prompt_ids"].status == coverage.FALLBACK
    assert "negative_prompt_ids" in status["negative_prompt_ids"].detail
    assert status["guidance_scale"].status == coverage.FALLBACK
    assert status["num_beams"].status == coverage.SERVED  # beam search on the engine
    assert status["num_beam_groups"].status == coverage.FALLBACK  # diverse beam search is not
    assert not [r.option.name for r in report["results"] if r.status == coverage.ERROR], (
        "a served option raised"
    )
    assert report["served"] + report["fallback"] <= len(report["results"])
    text = (tmp_path / "coverage.md").read_text()
    assert f"**{report['served']} of " in text and "| `negative_prompt_ids` (argument) |" in text
    assert coverage.unlisted_fields() == [], "a GenerationConfig field is neither a row nor bookkeeping"


def test_every_option_is_a_generate_argument_or_config_field():
    from transformers import GenerationConfig

    from hfaccel.patches.arguments import GENERATE_PARAMETERS

    fields = set(GenerationConfig().to_dict())
    for option in coverage.OPTIONS:
        name = option.name.split(" + ")[0]
        if option.argument:
            assert name in GENERATE_PARAMETERS or name in ("inputs_embeds", "past_key_values", "position_ids")
        else:
            assert name in fields, name


def test_bench_cli_knows_the_suite():
    args = build_parser().parse_args(["bench", "coverage", "--coverage-out", "somewhere"])
    assert args.suite == ["coverage"] and args.coverage_out == "somewhere"
