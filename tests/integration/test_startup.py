"""Startup mistakes that must not pass silently: a model path written with a trailing slash
serves under the model's name (the coordinator and the worker name it alike), and a
coordinator asked to listen on a port another one holds fails instead of sharing it."""

from .conftest import MODEL_DIR, Proc, executable


def test_model_path_with_a_trailing_slash_serves(cluster):
    c = cluster(workers=0)
    c.model_dir = f"{MODEL_DIR}/"  # a string: a Path would drop the slash
    c.add_worker(["--kv-cache-memory", "16MiB"])
    c.wait_serving(1)
    assert [w.model for w in c.status().workers] == ["kjv-tiny"], c.status()
    done = c.client.generate_text("In the beginning", max_new_tokens=4, temperature=0)
    assert done.finish_reason == "length"


def test_a_port_already_taken_is_refused(cluster):
    c = cluster(workers=0)
    second = Proc("second-coordinator",
                  [executable("kvgrid-coordinator"), "--model", MODEL_DIR, "--listen", c.addr],
                  c.log_dir / "second-coordinator.log")
    rc = second.popen.wait(timeout=30)
    assert rc != 0, second.describe()
    assert "cannot listen" in second.log(), second.describe()
    assert c.coordinator.alive()
