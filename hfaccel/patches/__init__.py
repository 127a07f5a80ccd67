"""Everything that touches transformers internals lives here."""
