"""`eagle-fx`: user errors are one line on stderr with exit code 2, before any slow loading;
--help shows defaults; generate takes several prompts and sampling flags and reports tokens/s."""
import sys

import pytest

from eagle_fx.cli import main


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_user_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    cases = [
        (["generate", "hi", "--max-new-tokens", "0"], "eagle-fx generate: error: --max-new-tokens must be >= 1"),
        (["generate", "  "], "eagle-fx generate: error: prompt 0 is empty"),
        (["generate", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
        (["generate", "hi", "--model-dir", "/nonexistent"], "--model-dir /nonexistent: no such folder"),
        (["generate", "hi", "--model-dir", str(tmp_path)], "no config.json there"),
        (["generate", "hi", "--model-dir", str(tmp_path / "bare")], "no tokenizer there"),
        (["generate", "hi", "--eagle-dir", str(tmp_path)], f"--eagle-dir {tmp_path}: no draft there"),
        (["train-draft", "--base", "/nonexistent", "--out", str(tmp_path / "o")], "not a Hugging Face model folder"),
        (["bench", "--num-prompts", "0"], "eagle-fx bench: error: --num-prompts must be >= 1"),
    ]
    for argv, message in cases:
        assert message in _error(argv, capsys)


def test_errors_come_before_loading(capsys):
    """The checks run before any model is loaded: a wrong flag answers at once."""
    import time

    started = time.perf_counter()
    _error(["generate", "hi", "--max-new-tokens", "0"], capsys)
    assert "transformers.models.llama.modeling_llama" not in sys.modules or time.perf_counter() - started < 5


def test_help_shows_defaults(capsys):
    for cmd in ("generate", "train-draft", "bench"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and "(default: " in out
        if cmd == "generate":
            assert "new tokens per prompt at most (default: 128)" in " ".join(out.split())


def test_generate_several_prompts_sampling_and_tokens_per_s(capsys):
    argv = ["generate", "Tell me about the sea.", "Write a poem.", "--max-new-tokens", "12"]
    main(argv + ["--temperature", "0.8", "--seed", "1"])
    first = capsys.readouterr()
    main(argv + ["--temperature", "0.8", "--seed", "1"])
    again = capsys.readouterr()
    assert first.out == again.out and first.out.count("--- prompt ") == 2
    assert "tokens/s" in first.err and "temperature 0.8" in first.err
