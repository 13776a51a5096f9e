"""Startup mistakes that must not pass silently: a model path written with a trailing slash
serves under the model's name (the coordinator and the worker name it alike), and a
coordinator asked to listen on a port another one holds fails instead of sharing it.
`--load-format dummy` serves a directory that holds no weights, in the shape of its
config.json."""

import shutil

from .conftest import MODEL_DIR, Proc, executable


def weightless_model(tmp_path):
    """kjv-tiny's config.json and tokenizer.json, without its weights."""
    d = tmp_path / "kjv-tiny-shape"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(MODEL_DIR / f, d / f)
    return d


def test_model_path_with_a_trailing_slash_serves(cluster):
    c = cluster(workers=0)
    c.model_dir = f"{MODEL_DIR}/"  # a string: a Path would drop the slash
    c.add_worker(["--kv-cache-memory", "16MiB"])
    c.wait_serving(1)
    assert [w.model for w in c.status().workers] == ["kjv-tiny"], c.status()
    done = c.client.generate_text("In the beginning", max_new_tokens=4, temperature=0)
    assert done.finish_reason == "length"


def test_dummy_weights_serve_without_a_checkpoint(cluster, tmp_path):
    c = cluster(workers=0, model_dir=weightless_model(tmp_path))
    plain = Proc("worker-checkpoint", [executable("kvgrid-worker"), "--model", c.model_dir,
                                       "--kv-cache-memory", "16MiB"],
                 c.log_dir / "worker-checkpoint.log")
    assert plain.popen.wait(timeout=60) != 0, plain.describe()
    assert "model.safetensors" in plain.log(), plain.describe()
    c.add_worker(["--load-format", "dummy", "--kv-cache-memory", "16MiB"])
    c.wait_serving(1)
    runs = [c.client.generate_text(prompt_token_ids=[258, 900, 44], max_new_tokens=12,
                                   temperature=0, ignore_eos=True) for _ in range(2)]
    assert len(runs[0].token_ids) == 12
    assert list(runs[0].token_ids) == list(runs[1].token_ids)  # the same weights every step


def test_a_port_already_taken_is_refused(cluster):
    c = cluster(workers=0)
    second = Proc("second-coordinator",
                  [executable("kvgrid-coordinator"), "--model", MODEL_DIR, "--listen", c.addr],
                  c.log_dir / "second-coordinator.log")
    rc = second.popen.wait(timeout=30)
    assert rc != 0, second.describe()
    assert "cannot listen" in second.log(), second.describe()
    assert c.coordinator.alive()


def _run_on_a_terminal(argv) -> tuple[int, str]:
    """Runs argv with stderr on a pseudo-terminal; returns its exit code and what it printed
    there."""
    import os
    import pty
    import subprocess
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=secondary)
        os.close(secondary)
        chunks = []
        while True:
            try:
                data = os.read(primary, 4096)
            except OSError:  # EIO once the child closed its side
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(primary)


def _load_argv(model) -> list:
    return [str(executable("kvgrid")), "run", "--model", str(model), "--prompt", "In the",
            "--max-new-tokens", "1", "--temperature", "0"]


def test_loading_shows_progress_on_a_terminal_and_not_in_logs(tmp_path):
    import subprocess
    import sys
    from .conftest import SOURCE_DIR
    gguf = tmp_path / "kjv-tiny.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(MODEL_DIR), "--out", str(gguf)], check=True)
    layers = __import__("json").loads((MODEL_DIR / "config.json").read_text())["num_hidden_layers"]
    for model in (MODEL_DIR, gguf):
        rc, err = _run_on_a_terminal(_load_argv(model))
        assert rc == 0, err
        # The last update counts every layer and every tensor of the file.
        lines = [l for l in err.replace("\r", "\n").splitlines() if "loading weights" in l]
        assert lines, err
        last = lines[-1]
        assert f"layer {layers}/{layers}" in last, err
        done, total = last.split(", ")[1].split(" ")[0].split("/")
        assert done == total and int(total) > 0, last
    # Not a terminal: nothing of the kind in the output a log would keep.
    piped = subprocess.run(_load_argv(MODEL_DIR), capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert "loading weights" not in piped.stderr
