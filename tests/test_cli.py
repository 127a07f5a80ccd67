"""`python -m hfaccel`: help everywhere, --version, the generate command and its one-line errors."""

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hfaccel
from hfaccel import cli
from hfaccel.cli import build_parser, main
from tests.helpers import hf_greedy, tiny_model, tiny_tokenizer


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices, action._choices_actions


def test_every_command_and_option_has_help():
    parser = build_parser()
    commands, command_actions = _subparsers(parser)
    assert set(commands) == {"generate", "serve", "demo", "doctor", "bench"}
    assert all(a.help for a in command_actions)
    for name, sub in [("hfaccel", parser), *commands.items()]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (
                f"{name} {action.option_strings or action.dest}"
            )


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"hfaccel {hfaccel.__version__} (torch ") and "transformers" in out


def test_version_from_the_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "hfaccel", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("hfaccel ")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_generate_from_arguments_applies_the_chat_template(model_folder, capsys):
    main(["generate", "--model", str(model_folder), "--max-new-tokens", "5", "hi", "there"])
    out = capsys.readouterr().out
    model, tokenizer = tiny_model(), tiny_tokenizer()
    for prompt in ("hi", "there"):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        expected = tokenizer.decode(hf_greedy(model, ids["input_ids"], 5), skip_special_tokens=True).strip()
        assert f"> {prompt}\n{expected}\n" in out


def test_generate_with_quantized_weights_answers_as_the_quantized_model(model_folder, capsys):
    pytest.importorskip("torchao")
    import hfaccel
    from hfaccel.patches.weights import apply_weights

    main(["generate", "--model", str(model_folder), "--max-new-tokens", "5", "--weights", "int8", "hi"])
    model, tokenizer = tiny_model(), tiny_tokenizer()
    apply_weights(model, "int8")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    expected = hfaccel.generate(model, [ids["input_ids"]], max_new_tokens=5, progress=False)[0].token_ids
    assert capsys.readouterr().out == tokenizer.decode(expected, skip_special_tokens=True).strip() + "\n"


def test_generate_samples_as_the_model_s_generation_config_says_unless_told(tmp_path, capsys):
    model, tokenizer = tiny_model(), tiny_tokenizer()
    model.generation_config.do_sample, model.generation_config.temperature = True, 1.5
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"]

    def answer(token_ids):
        return tokenizer.decode(token_ids, skip_special_tokens=True).strip() + "\n"

    sampled = hfaccel.generate(model, [ids], max_new_tokens=8, seed=4, progress=False)[0].token_ids
    assert sampled != hf_greedy(model, ids, 8), "the seed must sample away from the greedy answer"
    main(["generate", "--model", str(tmp_path), "--max-new-tokens", "8", "--seed", "4", "hi"])
    assert capsys.readouterr().out == answer(sampled)
    main(["generate", "--model", str(tmp_path), "--max-new-tokens", "8", "--temperature", "0", "hi"])
    assert capsys.readouterr().out == answer(hf_greedy(model, ids, 8))


def test_generate_reads_stdin_one_prompt_per_line(model_folder, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\n\nsecond\n"))
    main(["generate", "--model", str(model_folder), "--max-new-tokens", "3", "--no-chat-template"])
    out = capsys.readouterr().out
    assert out.count("> ") == 2 and "> first\n" in out and "> second\n" in out
    monkeypatch.setattr(sys, "stdin", io.StringIO("only one\n"))
    main(
        [
            "generate",
            "--model",
            str(model_folder),
            "--max-new-tokens",
            "3",
            "--temperature",
            "0.7",
            "--seed",
            "1",
        ]
    )
    assert "> " not in capsys.readouterr().out, "one prompt: just the answer"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--model", "/no/such/folder", "hi"], "--model /no/such/folder: no such folder"),
        (["generate", "--model", "/tmp", "hi"], "--model /tmp: no config.json there"),
        (
            ["generate", "--max-new-tokens", "0", "hi"],
            "argument --max-new-tokens: expected a positive integer",
        ),
        (["generate", "--temperature", "-1", "hi"], "argument --temperature: expected a number >= 0"),
        (["generate", "--weights", "fp8", "hi"], "argument --weights: invalid choice: 'fp8'"),
        (["demo", "--dtype", "int8"], "argument --dtype: invalid choice"),
        (["generate", "--device", "gpu0", "hi"], "--device gpu0: not a device (auto, cpu, cuda or cuda:N)"),
        (["generate", "--device", "meta", "hi"], "--device meta: hfaccel runs on cpu or cuda"),
        (["serve", "--device", "cuda:64"], "--device cuda:64: this machine has"),
        (["serve", "--weights", "int8", "--device", "meta"], "--device meta: hfaccel runs on cpu or cuda"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["serve", "--allowed-origins", "localhost:3000"], "argument --allowed-origins: expected '*' or"),
        (["serve", "--response-template", "{not json"], "--response-template: Expecting property name"),
        (["serve", "--response-template", '{"fields": {}}'], "--response-template: not a response template"),
        (
            ["serve", "--response-template", "/no/such.json"],
            "--response-template /no/such.json: no such file",
        ),
        (
            ["serve", "--chat-template", "/no/such/template.jinja"],
            "--chat-template /no/such/template.jinja: no such",
        ),
        (["serve", "--port", "70000"], "argument --port: expected a port in 0-65535"),
        (["serve", "--api-key", ""], "argument --api-key: the key is empty"),
        (
            ["serve", "--kv-cache-memory", "1.5"],
            "argument --kv-cache-memory: expected bytes (an integer > 0) or",
        ),
        (["serve", "--kv-cache-memory", "-1"], "argument --kv-cache-memory: expected bytes"),
        (["serve", "/no/such/dir"], "MODEL_DIR /no/such/dir: no such folder"),
        (["bench", "--callers", "0"], "argument --callers: expected a positive integer, got 0"),
        (["bench", "--step-batches", "x"], "argument --step-batches: expected a positive integer, got 'x'"),
        (["bench", "--systems", "nosuch"], "argument --systems: expected comma-separated names from"),
        (
            ["bench", "--goodput-systems", "nosuch"],
            "argument --goodput-systems: expected comma-separated names",
        ),
        (["bench", "--rates", "0"], "argument --rates: expected comma-separated numbers > 0"),
        (["bench", "nosuch"], "hfaccel bench: error: unknown suite(s) ['nosuch']"),
        (["bench", "--suites", ","], "hfaccel bench: error: unknown suite(s) []"),
        (["serve", "--host", ""], "argument --host: the address is empty"),
        (["generate", "--seed", "-1", "hi"], "argument --seed: expected an integer in [0, 2**63)"),
        (["doctor", "--model", "/no/such/folder"], "--model /no/such/folder: no such folder"),
        (["serve", "--max-model-len", "1"], "argument --max-model-len: expected an integer >= 2"),
        (["bench", "--step-e2e-repeats", "-1"], "argument --step-e2e-repeats: expected an integer >= 0"),
        (["bench", "--goodput-repeats", "0"], "argument --goodput-repeats: expected a positive integer"),
        (["bench", "--tpot-target-ms", "0"], "argument --tpot-target-ms: expected a number > 0"),
        (["bench", "--spec-new-tokens", "-5"], "argument --spec-new-tokens: expected a positive integer"),
        # Checked before the model loads and HF's baseline runs (minutes), not after.
        (["demo", "--tensor-parallel-size", "2"], "tensor_parallel_size=2 needs 2 processes: launch with"),
    ],
)
def test_bad_arguments_give_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(("hfaccel", "usage")), err


def test_a_broken_model_folder_is_one_line(tmp_path, capsys):
    tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "hi"])
    err = capsys.readouterr().err
    assert err.startswith(f"hfaccel generate: error: cannot load a model from {tmp_path}: ")
    assert len(err.strip().splitlines()) == 1


def test_a_file_or_an_adapter_folder_is_named_for_what_it_is(tmp_path, capsys):
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    for path, message in (
        (tmp_path / "weights.gguf", "a file, not a folder"),
        (tmp_path / "adapter", "a PEFT adapter folder"),
    ):
        with pytest.raises(SystemExit):
            main(["generate", "--model", str(path), "hi"])
        assert f"--model {path}: {message}" in capsys.readouterr().err


def test_kv_cache_memory_in_bytes_reaches_the_engine_as_an_int_and_the_checkpoints_dtype_is_kept(
    tmp_path, monkeypatch
):
    """An integer is bytes (it was read as a float, then refused as a fraction); by default a bfloat16
    checkpoint loads in bfloat16, as transformers' from_pretrained and `transformers serve` load it (it
    was float32 unless --dtype auto: twice the memory, and not the tokens transformers serve gives)."""
    pytest.importorskip("fastapi")
    import hfaccel.server.server as server

    seen = []
    monkeypatch.setattr(server, "run_forever", lambda *args, **options: seen.append((args, options)))
    tiny_model().to(torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    cli.run_serve(
        cli.build_parser().parse_args(
            ["serve", str(tmp_path), "--kv-cache-memory", "100000000"]
            + ["--allowed-origins", "http://a.example, https://b.example:8443"]
        )
    )
    (model, _), options = seen.pop()
    assert options["kv_cache_memory"] == 100_000_000 and isinstance(options["kv_cache_memory"], int)
    assert options["allowed_origins"] == ("http://a.example", "https://b.example:8443")
    assert next(model.parameters()).dtype == torch.bfloat16
    cli.run_serve(cli.build_parser().parse_args(["serve", str(tmp_path), "--dtype", "float32"]))
    assert next(seen.pop()[0][0].parameters()).dtype == torch.float32
    cli.run_serve(cli.build_parser().parse_args(["serve"]))  # the embedded SmolLM2: float32, exact
    assert next(seen.pop()[0][0].parameters()).dtype == torch.float32


def test_no_prompts_on_stdin(model_folder, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n\n"))
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(model_folder)])
    assert "no prompts on stdin (one per line)" in capsys.readouterr().err


def test_a_refused_prompt_is_named_and_the_others_are_answered(model_folder, capsys):
    """It was one line pointing at `.completions` (an attribute a command line cannot reach), naming the
    tensor an empty prompt became."""
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "generate",
                "--model",
                str(model_folder),
                "--no-chat-template",
                "--max-new-tokens",
                "3",
                "",
                "hi",
            ]
        )
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert "prompt 1 ('') refused: the prompt is empty: its text encodes to no token" in err
    assert ".completions" not in err and "> hi\n" in out and out.split("> hi\n")[1].strip()


def test_serve_answers_over_http_and_stops_cleanly_on_sigterm(model_folder):
    """`python -m hfaccel serve MODEL_DIR`: the folder's model under its folder name, on 127.0.0.1, a chat
    answer equal to hfaccel.generate's; SIGTERM shuts it down gracefully (uvicorn then re-raises the
    signal, so the process ends by SIGTERM, as process managers expect)."""
    pytest.importorskip("fastapi")
    import http.client
    import json
    import signal
    import socket
    import time

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "hfaccel", "serve", str(model_folder), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()
                time.sleep(0.2)
        messages = [{"role": "user", "content": "hi"}]
        body = {"model": model_folder.name, "messages": messages, "max_tokens": 5, "temperature": 0}
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200, answer
        expected = hfaccel.generate(tiny_model(), [messages], tokenizer=tiny_tokenizer(), max_new_tokens=5)[0]
        assert answer["choices"][0]["message"]["content"] == expected.text
    finally:
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=60)[0]
    assert server.returncode in (0, -signal.SIGTERM), output
    assert "Application shutdown complete" in output and "Traceback" not in output


def test_serve_passes_the_kv_cache_dtype_to_the_engine(monkeypatch):
    """`--kv-cache-dtype int8` reaches `patch` as the engine's KV dtype; left out, nothing is set."""
    pytest.importorskip("fastapi")
    import hfaccel.server.server as server

    seen = []
    monkeypatch.setattr(cli, "_load", lambda *args: (tiny_model(), tiny_tokenizer()))
    monkeypatch.setattr(server, "run_forever", lambda *args, **options: seen.append(options))
    for extra, expected in ((["--kv-cache-dtype", "int8"], "int8"), ([], None)):
        cli.run_serve(cli.build_parser().parse_args(["serve", *extra]))
        assert seen.pop().get("dtype") == expected
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


def test_device_auto_is_cuda_where_there_is_one_else_the_cpu(model_folder, monkeypatch):
    """`--device auto` (the default, as `transformers serve` has it) puts the model on the GPU when there
    is one; the loaded model's parameters are where the flag says."""
    from hfaccel.cli_loading import CommandError, resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert cli.build_parser().parse_args(["serve"]).device == "auto"
    model, _ = cli._load(str(model_folder), torch.float32, None, "cpu")
    assert next(model.parameters()).device.type == "cpu"
    if expected == "cpu":
        with pytest.raises(CommandError, match="--device cuda: this machine has no CUDA device"):
            resolve_device("cuda")
    else:
        model, _ = cli._load(str(model_folder), torch.float32, None, "auto")
        assert next(model.parameters()).device.type == "cuda"


def test_quantized_weights_stay_on_the_cpu_under_auto_and_refuse_a_gpu(model_folder, monkeypatch):
    """int8 / int4 linears run PyTorch's packed CPU kernels: `--device auto` keeps them on the CPU even
    where a GPU is, and an explicit GPU is refused before anything is loaded."""
    from hfaccel import cli_loading

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with a GPU, as auto sees it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli_loading, "_load_folder", lambda *args: pytest.fail("loaded before refusing"))
    with pytest.raises(cli_loading.CommandError, match="--weights int8 runs PyTorch's packed CPU kernels"):
        cli_loading.load_model(str(model_folder), torch.float32, "int8", "cuda")
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, _ = cli_loading.load_model(str(model_folder), torch.float32, "int8", "auto")
    assert next(model.parameters()).device.type == "cpu"


def test_serve_reads_its_templates_from_files_or_as_given(tmp_path):
    from hfaccel.cli import _read_templates
    from tests.server.conftest import TEMPLATE

    (tmp_path / "reply.json").write_text(json.dumps(TEMPLATE))
    (tmp_path / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    assert _read_templates(str(tmp_path / "chat.jinja"), str(tmp_path / "reply.json")) == (
        "{{ messages[0]['content'] }}",
        TEMPLATE,
    )
    assert _read_templates("{{ 1 }}", json.dumps(TEMPLATE)) == ("{{ 1 }}", TEMPLATE)
    assert _read_templates(None, None) == (None, None)


def test_kv_cache_memory_of_1_is_all_of_the_free_memory():
    from hfaccel.cli import build_parser

    assert build_parser().parse_args(["serve", "--kv-cache-memory", "1"]).kv_cache_memory == 1.0


@pytest.mark.parametrize(
    ("templates", "message"),
    [
        (
            ["--response-template", "examples/response_templates/hermes.json"],
            "its start_anchor '<|im_start|>",
        ),
        (["--chat-template", "{{ bad"], "--chat-template: it cannot render a conversation"),
    ],
)
def test_serve_refuses_templates_that_do_not_fit_the_model_before_serving(
    model_folder, templates, message, capsys, monkeypatch
):
    """A response template of another chat format read the prompt as the reply (the system prompt came
    back as the answer); a broken chat template was taken and every chat request refused as the client's."""
    import hfaccel.server.server as server

    monkeypatch.setattr(server, "run_forever", lambda *a, **k: pytest.fail("it served"))
    with pytest.raises(SystemExit) as info:
        main(["serve", str(model_folder), *templates])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_reply_read_with_another_formats_template_holds_no_prompt_text():
    from hfaccel.patches.reply_parsing import parse_reply

    template = json.loads(Path("examples/response_templates/hermes.json").read_text())
    assert parse_reply(template, "SECRET-SYSTEM<u>hi<a>", ["d", "D"], None).content == "dD"


def test_a_model_folder_without_a_tokenizer_says_so(tmp_path, capsys):
    """transformers' message for it was about sentencepiece and tiktoken."""
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(tmp_path), "hi"])
    assert info.value.code == 2
    assert f"--model {tmp_path}: no tokenizer there (none of tokenizer.json" in capsys.readouterr().err


def test_help_and_version_import_neither_torch_nor_transformers():
    """`hfaccel --help` took 4 s (torch and transformers imported by `import hfaccel` and the parser); the
    public names are imported at first use now."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "import hfaccel.cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    hfaccel.cli.main(['--version'])\n"
        "hfaccel.cli.build_parser().format_help()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "import hfaccel\n"
        "print(hasattr(hfaccel, '__main__'), hasattr(hfaccel, 'a.b'))\n"  # (importing __main__ runs the CLI)
        "print(hfaccel.patch.__module__, hfaccel.EngineConfig.__name__, hfaccel.engine.loop.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "False False", "hfaccel.api.patching EngineConfig hfaccel.engine.loop"]
