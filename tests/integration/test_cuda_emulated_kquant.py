"""A K-quant GGUF model on the CUDA path, on the CUDA emulator (tests/cuda_emu): a worker
with `--device cuda` serving the trained model in Q6_K (tools/make_kquant_gguf.py: embedding,
q/k/v/o, gate/up and head in Q6_K blocks, uploaded as the CPU holds them and decoded inside the
quantized GEMV/GEMM kernels) gives the greedy tokens `kvgrid run` gives on the CPU for the
same file; and so does the model with its types mixed as a Q4_K_M file mixes them (--mix
q4_k_m: q/k/v and gate/up held as parts of Q4_K and Q6_K) and no output.weight (the head tied
to the embedding's Q8_0 blocks, which the lookup decodes on the card)."""

import subprocess
import sys

import pytest

from .conftest import MODEL_DIR, SOURCE_DIR
# emulated_plugin is autouse: imported here, it points this module's workers at the plugin.
from .test_cuda_emulated import CUDA_FLAGS, PROMPT_IDS, emulated_plugin  # noqa: F401
from .test_tensor_parallel import run_json

pytest.importorskip("gguf")


@pytest.fixture(scope="module", params=["q6_k", "q4_k_m-tied"])
def q6_k_model(tmp_path_factory, request):
    d = tmp_path_factory.mktemp(request.param)
    f32, q6 = d / "f32.gguf", d / f"kjv-tiny-{request.param}.gguf"
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "export_gguf.py"), "--model",
                    str(MODEL_DIR), "--out", str(f32)], check=True)
    flags = ["--mix", "q4_k_m", "--drop-output"] if request.param == "q4_k_m-tied" else []
    subprocess.run([sys.executable, str(SOURCE_DIR / "tools" / "make_kquant_gguf.py"), "--src",
                    str(f32), "--out", str(q6), *flags], check=True)
    return q6


def test_q6_k_gguf_on_the_emulated_card_gives_the_cpu_tokens(cluster, q6_k_model):
    want = run_json(q6_k_model, "--prompt-ids", ",".join(map(str, PROMPT_IDS)), "--temperature",
                    0, "--max-new-tokens", 16, "--ignore-eos")["token_ids"]
    c = cluster(workers=0, model_dir=q6_k_model)
    w = c.add_worker(CUDA_FLAGS)
    c.wait_serving(1)
    got = c.client.generate_text(prompt_token_ids=PROMPT_IDS, max_new_tokens=16, temperature=0,
                                 ignore_eos=True)
    assert list(got.token_ids) == want
    assert "kvgrid CUDA emulator" in w.log(), w.describe()
