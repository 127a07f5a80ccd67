"""A request's `cache_salt` (its LoRA adapter) separates prefix-cache keys: equal prompts share blocks
only when their salts are equal."""

from hfaccel.engine.block_manager import BlockManager
from hfaccel.engine.request import Request, StoppingParams

PROMPT = list(range(3, 3 + 13))  # three full 4-token blocks and one more token


def admit(manager: BlockManager, salt: str | None, request_id: int = 0) -> Request:
    """Admit, compute and register a request for PROMPT with `salt`; returns it."""
    request = Request(request_id, list(PROMPT), StoppingParams(max_new_tokens=4), cache_salt=salt)
    request.num_computed_tokens = manager.match_prefix(request)
    request.num_cached_prompt_tokens = request.num_computed_tokens
    assert manager.allocate(request, len(PROMPT) - request.num_computed_tokens)
    request.num_computed_tokens = len(PROMPT)
    manager.cache_full_blocks(request)
    return request


def test_equal_salts_share_and_different_salts_do_not():
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    first = {salt: admit(manager, salt) for salt in (None, "math", "code")}
    assert all(r.num_cached_prompt_tokens == 0 for r in first.values()), "no salt sees another's blocks"
    assert manager.num_cached_blocks == 9
    for salt, earlier in first.items():
        again = admit(manager, salt, request_id=1)
        assert again.num_cached_prompt_tokens == 12
        assert again.block_ids[:3] == earlier.block_ids[:3]
    keys = {salt: manager.prefix_keys(r)[0] for salt, r in first.items()}
    assert len(set(keys.values())) == 3 and keys[None][0] == 0, "an unsalted request keeps the plain key"


def test_salted_chain_continues_after_an_incremental_registration():
    """Registration in two steps (a chunked prompt) chains from the salted root, as one step would."""
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    request = Request(0, list(PROMPT), StoppingParams(max_new_tokens=4), cache_salt="math")
    manager.match_prefix(request)
    manager.allocate(request, len(PROMPT))
    request.num_computed_tokens = 4
    manager.cache_full_blocks(request)
    request.num_computed_tokens = len(PROMPT)
    manager.cache_full_blocks(request)
    assert admit(manager, "math", request_id=1).num_cached_prompt_tokens == 12
    assert admit(manager, None, request_id=2).num_cached_prompt_tokens == 0
