"""Every command and snippet of README.md, docs/*.md and examples/data/README.md works as written.

- Trainer and parameter-count commands: validated for their layout by tests/test_presets.py.
- Every other shell command is classified here and checked: a Makefile target exists, a tool's
  arguments parse with the tool's own parser (engram-export, engram-preprocess, engram-plot,
  the benchmark and maintenance scripts; nothing runs), a shell tool is on PATH. A command
  nothing here knows fails the test: document how it is checked.
- The README's "Your first hour" runs as written in a scratch directory (the shipped data linked
  in), trainer runs at 1/50 of their iterations: the demo with checkpoints, a changed run and
  the plot, the resume, the export; then every Python block of the docs not marked
  ``# excerpt`` runs there (the serving snippet on the first hour's export).
- Python blocks marked ``# excerpt`` (a cluster's start-up, ...) compile.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from launch import REPO, free_port, run_process
from test_presets import COMMANDS as VALIDATED_BY_PRESETS
from test_presets import parse as trainer_command

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "examples" / "data" / "README.md"]
VENV_BIN = Path(sys.executable).parent
# console scripts (pyproject.toml) and `python -m` modules -> (module, function)
TOOLS = {
    "engram-export": ("engram_train.export", "main"),
    "engram_train.export": ("engram_train.export", "main"),
    "engram-preprocess": ("engram_train.data.preprocess", "main"),
    "engram-plot": ("engram_train.plot", "main"),
    "engram-import-hf": ("engram_train.hf.importer", "main"),
    "engram_train.hf.importer": ("engram_train.hf.importer", "main"),
    "engram-sweep": ("engram_train.sweep.sweep_cli", "main"),
    "engram-plan": ("engram_train.memory_plan.plan_cli", "main"),
    "engram_train.memory_plan": ("engram_train.memory_plan.plan_cli", "main"),
    "engram-logits": ("engram_train.inference.logits", "main"),
    "engram_train.inference.logits": ("engram_train.inference.logits", "main"),
}
SHELL_TOOLS = {"ls", "tail", "cat", "tensorboard"}
# Commands the first-hour run validates instead of running: the environment is already set up
# (make install, source), a server runs until stopped (tensorboard).
NOT_RUN = ("make", "source", "tensorboard")
SCALE = 50  # trainer iterations in the first-hour run: 1/50 of the documented ones


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def shell_commands(text: str) -> list[str]:
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def doc_commands() -> list[tuple[str, str]]:
    return [(path.relative_to(REPO).as_posix(), c) for path in DOCS
            for block in blocks(path, "(?:bash|sh|shell)") for c in shell_commands(block)]


def python_blocks() -> list[tuple[str, str]]:
    return [(path.relative_to(REPO).as_posix(), b) for path in DOCS for b in blocks(path, "python")]


def is_excerpt(block: str) -> bool:
    return block.lstrip().startswith("# excerpt")


def words_of(command: str) -> list[str]:
    words = shlex.split(command.replace("$", ""))
    return [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # environment assignments


# -- every shell command is checked --------------------------------------------------------------


class _Parsed(Exception):
    pass


@contextlib.contextmanager
def parse_only():
    """argparse parses as usual, then stops the tool: its arguments are checked, nothing runs."""
    depth = [0]
    originals = {name: getattr(argparse.ArgumentParser, name)
                 for name in ("parse_args", "parse_known_args", "parse_intermixed_args")}

    def wrap(original):
        def parse(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(result)
            return result
        return parse

    for name, original in originals.items():
        setattr(argparse.ArgumentParser, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(argparse.ArgumentParser, name, original)


def _script_main(path: Path):
    name = f"_doc_{path.stem}"
    if name in sys.modules:
        return sys.modules[name].main
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module.main


def tool_and_argv(words: list[str]):
    """(main function, argv) of a documented tool invocation, or None."""
    if words[0] in TOOLS:
        module, function = TOOLS[words[0]]
        return getattr(importlib.import_module(module), function), words[1:]
    if words[0] in ("python", "torchrun"):
        rest = words[1:]
        while words[0] == "torchrun" and rest and rest[0].startswith("--"):  # torchrun's own options
            rest = rest[1:] if "=" in rest[0] else rest[2:]
        if rest[:1] == ["-m"] and rest[1] in TOOLS:
            module, function = TOOLS[rest[1]]
            return getattr(importlib.import_module(module), function), rest[2:]
        if rest and rest[0].endswith(".py"):
            return _script_main(REPO / rest[0]), rest[1:]
    return None


def check_command(command: str) -> str:
    """How ``command`` is checked (raises when it does not hold)."""
    if command in v41_recipe_commands():  # its --config-dir is an import the recipe writes
        return "run at tiny size by test_v41_recipe_runs_at_tiny_size"
    if trainer_command(command) is not None:
        assert any(c["command"] == command for c in VALIDATED_BY_PRESETS) or "examples/" in command, command
        return "layout validated by test_presets.py"
    words = words_of(command)
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M)
        assert all(w in targets or "=" in w for w in words[1:]), f"{command}: not a Makefile target"
        return "Makefile target"
    if words[0] == "source":
        assert (REPO / words[1]).exists() or words[1] == ".venv/bin/activate", command
        return "file exists"
    if words[0] in SHELL_TOOLS:
        assert shutil.which(words[0], path=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"), words[0]
        return "on PATH"
    found = tool_and_argv(words)
    assert found is not None, f"{command!r}: no check knows this command (tests/test_docs.py)"
    main, argv = found
    with parse_only():
        try:
            main(argv)
        except _Parsed:
            return "arguments parse"
        except SystemExit as e:  # --help exits 0; a bad argument exits 2
            assert e.code in (0, None), f"{command!r}: the tool refused its arguments (exit {e.code})"
            return "help"
    raise AssertionError(f"{command!r}: the tool never parsed its arguments")


@pytest.mark.parametrize("where, command", doc_commands(), ids=lambda x: x[:80])
def test_every_documented_command_is_checked(where, command):
    check_command(command)


def test_param_count_takes_flags_and_overrides_in_any_order():
    from engram_train.training import param_count

    seen = []
    with parse_only():
        for argv in (["model=deepseek_v3_small", "--world-size", "8", "system.tensor_model_parallel_size=2"],
                     ["--world-size", "8", "model=deepseek_v3_small", "system.tensor_model_parallel_size=2"]):
            with pytest.raises(_Parsed) as parsed:
                param_count.main(argv)
            seen.append(parsed.value.args[0])
    assert seen[0] == seen[1] and seen[0].world_size == 8
    assert seen[0].overrides == ["model=deepseek_v3_small", "system.tensor_model_parallel_size=2"]


def test_unknown_commands_are_refused():
    with pytest.raises(AssertionError, match="no check knows"):
        check_command("frobnicate --all")
    with pytest.raises(AssertionError, match="refused its arguments"):
        check_command("engram-export --no-such-flag")


def test_excerpts_compile_and_are_marked():
    found = python_blocks()
    assert found
    for where, block in found:
        compile(block, where, "exec")


# -- the first hour, as written ------------------------------------------------------------------


def first_hour_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Your first hour", 1)[1].split("\n## ", 1)[0]
    return [c for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S) for c in shell_commands(block)]


def shrink(command: str) -> str:
    """A trainer run at 1/SCALE of its iterations, logging and validating within them."""
    if trainer_command(command) is None:
        return command
    iters = re.search(r"train\.train_iters=(\d+)", command)
    n = int(iters.group(1)) if iters else 200
    command = re.sub(r"train\.train_iters=\d+", "", command)
    command = command.replace("torchrun ", f"torchrun --master-port={free_port()} ", 1)
    return (f"{command} train.train_iters={n // SCALE} train.log_interval=2 train.eval_interval=2 "
            "train.eval_iters=1")


# The first hour's programs, as `python -m` runs them: the console scripts' own entry points
# (pyproject.toml; torch's `torchrun` is `torch.distributed.run:main`). Started that way, the
# test zygote forks them (tests/zygote.py) instead of a fresh interpreter importing torch and
# megatron-core for each: the same arguments, as written, reach the same `main`.
AS_MODULE = {
    "torchrun": "torch.distributed.run",
    "engram-train": "engram_train.train",
    "engram-plot": "engram_train.plot",
    "engram-export": "engram_train.export",
}


def as_launched(command: str, env: dict) -> tuple[list[str], dict] | None:
    """``command``'s argv and environment with its program run as ``python -m`` (``AS_MODULE``),
    or None where the shell must run it (another program, or anything but words and leading
    ``NAME=value`` assignments)."""
    if re.search(r"[|&;<>()$`*?~\\\[\]{}'\"]", command):
        return None
    words = command.split()
    env = dict(env)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words or words[0] not in AS_MODULE:
        return None
    return [sys.executable, "-m", AS_MODULE[words[0]], *words[1:]], env


def test_first_hour_commands_launch_as_their_entry_points():
    """The console scripts ``as_launched`` runs as modules are the installed ones' entry points."""
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["torchrun"] == "torch.distributed.run:main"
    for name in ("engram-train", "engram-plot", "engram-export"):
        assert scripts[name] == f"{AS_MODULE[name]}:main", name
    # `python -m engram_train.export` runs the package's __main__, which calls the same main
    from engram_train.export import export_cli, main

    assert main is export_cli.main
    assert "main()" in (REPO / "engram_train" / "export" / "__main__.py").read_text()
    for module in ("engram_train.plot", "engram_train.train"):
        source = (REPO / Path(*module.split("."))).with_suffix(".py").read_text()
        assert re.search(r'if __name__ == "__main__":\n    (sys\.exit\()?main\(\)', source), module
    for command in first_hour_commands():
        launched = as_launched(command, {})
        if launched is not None:
            argv, env = launched
            assert argv[3:] == words_of(command)[1:], command
            assert all(f"{k}={v}" in command for k, v in env.items()), command
    assert as_launched("OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m x a=b", {"A": "1"}) == (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "x", "a=b"],
        {"A": "1", "OMP_NUM_THREADS": "1"})
    assert as_launched("ls outputs/demo", {}) is None
    assert as_launched("engram-plot a > b", {}) is None


def test_first_hour_runs_as_written(tmp_path):
    commands = first_hour_commands()
    assert any("engram-export" in c for c in commands) and any("checkpoint.load=" in c for c in commands)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1",
               ENGRAM_SHOW_WARNINGS="0")
    env.pop("ENGRAM_DATA_PATH", None)
    outputs = {}
    for command in commands:
        if words_of(command)[0] in NOT_RUN:
            check_command(command)
            continue
        command_line = shrink(command)
        argv, run_env = as_launched(command_line, env) or (["bash", "-c", command_line], env)
        proc = run_process(argv, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs[command] = proc.stdout + proc.stderr

    demo = tmp_path / "outputs" / "demo"
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "train.log", "tensorboard"):
        assert (demo / name).exists(), name
    console = next(out for c, out in outputs.items() if "checkpoint.save=" in c and "checkpoint.load" not in c)
    iteration_lines = [l for l in console.splitlines() if re.match(r" \[.*\] iteration ", l)]
    assert [l for l in iteration_lines if re.search(r"iteration +4/ +4 \|", l)], console[-2000:]
    logged = (demo / "train.log").read_text()
    assert all(line in logged for line in iteration_lines)  # train.log holds the console's lines
    assert "validation loss at iteration 2" in logged
    from engram_train.logs import KNOWN_WARNINGS

    for known in KNOWN_WARNINGS:  # filtered once at start-up
        assert not re.search(known.pattern, console), known.pattern
    assert (tmp_path / "compare.png").exists()
    assert (tmp_path / "exports" / "demo" / "engram_config.json").exists()
    assert '"iteration": 6' in (demo / "metrics.jsonl").read_text()  # the resume ran on

    # every Python block of the docs that is not an excerpt, where the first hour left off
    runnable = [(where, b) for where, b in python_blocks() if not is_excerpt(b)]
    assert runnable
    for where, block in runnable:
        proc = run_process([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, f"{where}:\n{block}\n{proc.stderr[-3000:]}"


def test_own_data_preprocess_runs_as_written(tmp_path):
    """README, "Your own data": engram-preprocess on the shipped corpus, as written."""
    text = (REPO / "README.md").read_text().split("### Your own data", 1)[1].split("\n## ", 1)[0]
    commands = [c for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for c in shell_commands(b)]
    preprocess = [c for c in commands if c.startswith("engram-preprocess")]
    assert len(preprocess) == 1
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    proc = run_process(["bash", "-c", preprocess[0]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    shipped = REPO / "examples" / "data" / "demo_text_document"
    for suffix in (".bin", ".idx"):  # the shipped dataset is this command's output
        made = tmp_path / "outputs" / f"my_corpus_text_document{suffix}"
        assert made.read_bytes() == shipped.with_suffix(suffix).read_bytes(), suffix



def v41_recipe_commands() -> list[str]:
    """docs/deepseek-v41.md 'Import and export': the recipe's commands (its first bash block)."""
    text = (REPO / "docs" / "deepseek-v41.md").read_text().split("\n## Import and export", 1)[1]
    return shell_commands(re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0])


def test_v41_recipe_runs_at_tiny_size(tmp_path):
    """The V4.1 recipe as written (import with FP8 tables on the host, at TP2 x EP2 too,
    continued training, export) on NeMo's tiny V4.1 quantized by the project's encoder
    (tests/test_v41_quant_folder.py), its paths moved into a scratch folder, the trainer at
    2 steps of 2 x 32 tokens; the export has the source's names, dtypes and shapes."""
    import v41_reference as ref
    from test_v41_quant_folder import nemo_quantized_folder
    from v41_folders import folder_tensors

    commands = v41_recipe_commands()
    assert [words_of(c)[0] for c in commands] == [
        "engram-import-hf", "torchrun", "torchrun", "engram-export"], commands
    with ref.side():
        nemo_quantized_folder(tmp_path / "release")
    moved = {"/models/v41_continued": tmp_path / "served", "/models/v41": tmp_path / "release",
             "/ckpt/": f"{tmp_path}/ckpt/", "/runs/": f"{tmp_path}/runs/",
             "/data/corpus_text_document": REPO / "examples" / "data" / "demo_text_document"}
    modules = {"engram-import-hf": "engram_train.hf.importer", "engram-export": "engram_train.export"}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ENGRAM_SHOW_WARNINGS="0")
    for command in commands:
        for path, where in moved.items():
            command = command.replace(path, str(where))
        words = words_of(command)
        if words[0] == "torchrun":
            argv = [sys.executable, "-m", "torch.distributed.run", f"--master-port={free_port()}",
                    *words[1:]]
        else:
            argv = [sys.executable, "-m", modules[words[0]], *words[1:]]
        if "engram_train.train" in words:
            argv += ["train.train_iters=2", "train.global_batch_size=2", "train.micro_batch_size=1",
                     "train.seq_length=32", "train.eval_interval=null", "train.log_interval=1",
                     "train.lr_warmup_iters=0"]
        proc = run_process(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    source, served = folder_tensors(tmp_path / "release"), folder_tensors(tmp_path / "served")
    assert sorted(served) == sorted(source)
    for name, value in served.items():
        assert (value.dtype, value.shape) == (source[name].dtype, source[name].shape), name
