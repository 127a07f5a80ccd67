"""Which of transformers' ``generate`` options run on the engine, and which fall back to HF's generate.

Every `GenerationConfig` field that changes what ``generate`` does (pure bookkeeping is listed apart, with
why) and ``generate``'s own arguments, each set to a representative non-default value on a tiny random
Llama patched with ``strict=True``: a call that returns was **served** by the engine; one that raises
hfaccel's strict-mode error **falls back** (it would run on HF's original ``generate`` with one warning).
A call that raises anything else is run on unpatched HF too: if HF refuses it as well the option does not
apply to this model (**n/a**, outside the share); otherwise it is an **error** of hfaccel's (a bug).
Options that only mean something inside a mode (beam, assisted) are set together with that mode.

Served means no fallback, not parity: parity with HF is what the test suites check, option by option.
The run is deterministic (seeded model, fixed inputs) and takes seconds on a CPU:

    python -m hfaccel bench coverage            # writes bench-results/coverage.{md,png}
    python -m hfaccel.bench.coverage --out docs  # or anywhere
"""

# ruff: noqa: E501 - the option table reads best one option per line
from __future__ import annotations

import argparse
import contextlib
import io
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from hfaccel.bench.coverage_options import BOOKKEEPING, DROP, OPTIONS, Option

SERVED, FALLBACK, NOT_APPLICABLE, ERROR = "served", "falls back", "n/a", "error"


@dataclass
class Result:
    option: Option
    status: str
    detail: str  # the fallback reason, or the error


class _Context:
    """The tiny model, its inputs, and the objects the options need (made once, deterministic)."""

    def __init__(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(config).eval()
        torch.manual_seed(1)
        self.assistant = LlamaForCausalLM(config).eval()
        self.tokenizer = _char_tokenizer()
        self.ids = torch.tensor([[0, 0, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25]])
        self.mask = (self.ids != 0).long()
        self.width = self.ids.shape[1]

    def base(self) -> dict[str, Any]:
        return {"input_ids": self.ids, "attention_mask": self.mask, "max_new_tokens": 4, "do_sample": False}

    def one_row(self) -> dict[str, Any]:
        return {"input_ids": self.ids[1:], "attention_mask": self.mask[1:]}

    def embeds(self) -> torch.Tensor:
        with torch.no_grad():
            return self.model.get_input_embeddings()(self.ids)

    def positions(self) -> torch.Tensor:
        return (self.mask.cumsum(-1) - 1).clamp(min=0)

    def continuation(self) -> dict[str, Any]:
        """A DynamicCache of the inputs' first 4 positions (a forward call), then the whole inputs."""
        from transformers import DynamicCache

        from hfaccel.patches.arguments import CACHE_NAME

        with torch.no_grad():
            out = self.model(
                self.ids[:, :4],
                attention_mask=self.mask[:, :4],
                **{CACHE_NAME: DynamicCache(config=self.model.config)},
            )
        return {CACHE_NAME: getattr(out, CACHE_NAME)}

    def criteria(self) -> Any:
        from transformers import StoppingCriteria, StoppingCriteriaList

        class NeverStop(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([NeverStop()])

    def processors(self) -> Any:
        from transformers import LogitsProcessor, LogitsProcessorList

        class Identity(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                return scores

        return LogitsProcessorList([Identity()])

    @staticmethod
    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        return list(range(128))

    def streamer(self) -> Any:
        from transformers.generation.streamers import BaseStreamer

        class Collect(BaseStreamer):
            def __init__(self) -> None:
                self.tokens: list[Any] = []

            def put(self, value: Any) -> None:
                self.tokens.append(value)

            def end(self) -> None:
                pass

        return Collect()

    def watermark(self) -> Any:
        from transformers.generation import WatermarkingConfig

        return WatermarkingConfig(bias=2.0)

    @staticmethod
    def constraint() -> Any:
        class Constraint:  # transformers 5 moved its Constraint classes to the Hub with constrained beam search
            token_ids = [5, 6]

        return Constraint()

    @staticmethod
    def custom_generate(model: Any, *args: Any, **kwargs: Any) -> Any:
        return kwargs.get("input_ids")


def _char_tokenizer() -> Any:
    """A character-level fast tokenizer over printable ASCII (ids 3..97); pad 0, bos 1, eos 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({chr(c): 3 + i for i, c in enumerate(range(32, 127))})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="?"
    )
    tokenizer.padding_side = "left"
    return tokenizer


def _call_kwargs(context: _Context, option: Option) -> dict[str, Any]:
    kwargs = context.base()
    kwargs.update(option.kwargs(context))
    return {k: v for k, v in kwargs.items() if v is not DROP}


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


def classify(context: _Context, option: Option) -> Result:
    """Run one option on the strict patched model (and on HF when it raises something else)."""
    prefix = "hfaccel (strict=True) does not serve "
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            torch.manual_seed(0)
            context.model.generate(**_call_kwargs(context, option))
            return Result(option, SERVED, "")
        except ValueError as error:
            if str(error).startswith(prefix):
                reason = str(error)[len(prefix) :].split("; patch without strict")[0]
                return Result(option, FALLBACK, reason)
            ours = error
        except Exception as error:  # noqa: BLE001 - every failure is a finding
            ours = error
        try:
            torch.manual_seed(0)
            type(context.model).generate(context.model, **_call_kwargs(context, option))
        except Exception as error:  # noqa: BLE001
            return Result(option, NOT_APPLICABLE, f"HF refuses it too: {_first_line(error)}")
        return Result(option, ERROR, _first_line(ours))


def unlisted_fields() -> list[str]:
    """GenerationConfig fields that are neither a row nor bookkeeping (a newer transformers added them)."""
    from transformers import GenerationConfig

    listed = {o.name for o in OPTIONS} | set(BOOKKEEPING)
    return sorted(set(GenerationConfig().to_dict()) - listed)


def run_coverage(
    out_dir: str | None = "bench-results", plot: bool = True, verbose: bool = True
) -> dict[str, Any]:
    """Classify every option; write ``coverage.md`` (and ``coverage.png``) into `out_dir` unless None.
    Returns ``{"results": [...], "served": n, "fallback": n, "share": f, "markdown": str}``."""
    import hfaccel

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the removed decoding modes look for code on the Hub
    from transformers.utils import logging as hf_logging

    start = time.perf_counter()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # HF's notes on flags a mode ignores
    context = _Context()
    hfaccel.patch(context.model, strict=True, block_size=8, kv_cache_memory=2_000_000, compile="off")
    try:
        results = [classify(context, option) for option in OPTIONS]
    finally:
        hfaccel.unpatch(context.model)
        hf_logging.set_verbosity(verbosity)
    served = sum(r.status == SERVED for r in results)
    fallback = sum(r.status == FALLBACK for r in results)
    counted = sum(r.status != NOT_APPLICABLE for r in results)  # an error is not served
    report = {
        "results": results,
        "served": served,
        "fallback": fallback,
        "counted": counted,
        "share": served / counted if counted else 0.0,
        "seconds": time.perf_counter() - start,
    }
    report["markdown"] = markdown(report)
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "coverage.md"), "w") as f:
            f.write(report["markdown"])
        if plot:
            report["png"] = plot_coverage(report, os.path.join(out_dir, "coverage.png"))
    if verbose:
        print(report["markdown"])
        print(f"({report['seconds']:.1f} s)")
    return report


def _versions() -> str:
    import transformers

    import hfaccel

    return (
        f"hfaccel {hfaccel.__version__}, transformers {transformers.__version__}, torch {torch.__version__}"
    )


def markdown(report: dict[str, Any]) -> str:
    """The table (one row per option), the share served, per-group counts, and what is left out."""
    results: list[Result] = report["results"]
    lines = [
        f"**{report['served']} of {report['counted']} options served on the engine "
        f"({100 * report['share']:.0f}%)**, {report['fallback']} fall back to HF's generate"
        + "".join(
            f", {sum(r.status == s for r in results)} {s}"
            for s in (NOT_APPLICABLE, ERROR)
            if any(r.status == s for r in results)
        )
        + f" ({_versions()}).",
        "",
        "| group | served | falls back | error |",
        "| --- | ---: | ---: | ---: |",
    ]
    for group in dict.fromkeys(r.option.group for r in results):
        counts = [
            sum(r.status == s and r.option.group == group for r in results) for s in (SERVED, FALLBACK, ERROR)
        ]
        lines.append(f"| {group} | {' | '.join(map(str, counts))} |")
    lines += ["", "| group | option | value set | result | reason |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        name = f"`{r.option.name}`" + (" (argument)" if r.option.argument else "")
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| {r.option.group} | {name} | {r.option.value} | {r.status} | {detail} |")
    lines += ["", "Not rows (they change nothing generate computes, or only parameterise another row): "]
    lines.append(
        ", ".join(f"`{name}` ({why})" for name, why in BOOKKEEPING.items() if not name.startswith("_")) + "."
    )
    unlisted = unlisted_fields()
    if unlisted:
        lines += ["", f"GenerationConfig fields this table does not know yet: {', '.join(unlisted)}."]
    return "\n".join(lines) + "\n"


def plot_coverage(report: dict[str, Any], path: str) -> str | None:
    """A horizontal bar per group: options served and falling back. None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    results: list[Result] = report["results"]
    groups = list(dict.fromkeys(r.option.group for r in results))
    served = [sum(r.status == SERVED and r.option.group == g for r in results) for g in groups]
    fallback = [sum(r.status == FALLBACK and r.option.group == g for r in results) for g in groups]
    failed = [sum(r.status == ERROR and r.option.group == g for r in results) for g in groups]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(groups) + 1.4))
    y = list(range(len(groups)))[::-1]
    ax.barh(y, served, color="#2a9d8f", label="served on the engine")
    ax.barh(y, fallback, left=served, color="#e9c46a", label="falls back to HF generate")
    if any(failed):
        left = [s + f for s, f in zip(served, fallback)]
        ax.barh(y, failed, left=left, color="#e76f51", label="error on the engine")
    totals = [s + f + e for s, f, e in zip(served, fallback, failed)]
    for yi, s, total in zip(y, served, totals):
        ax.text(total + 0.15, yi, f"{s}/{total}", va="center", fontsize=9)
    ax.set_yticks(y)
    ax.set_yticklabels(groups)
    ax.set_xlabel("options")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlim(0, max(totals) + 2)
    ax.set_title(
        f"HF generate options served by hfaccel: {report['served']}/{report['counted']} "
        f"({100 * report['share']:.0f}%)",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hfaccel.bench.coverage", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default="bench-results", help="folder for coverage.md and coverage.png")
    parser.add_argument("--no-plot", action="store_true", help="write the markdown only")
    args = parser.parse_args(argv)
    run_coverage(args.out, plot=not args.no_plot)


if __name__ == "__main__":
    main()
