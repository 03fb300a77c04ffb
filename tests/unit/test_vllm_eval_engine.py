"""evaluate --engine vllm in the real engine (skipped where none is installed; CI installs it with
`make engine-vllm`): SmolLM2-135M-Instruct served alone and with an EAGLE-3 drafter, two engine startups, on a chat
split and on two MT-Bench questions in the release's two-turn form.

The drafter is made from the target's own weights, not trained (training one takes minutes): its one layer adds
nothing (o_proj and down_proj zero), `fc` passes the deepest tap through, and its norm and LM head are the
target's. It goes through the same export and server as a trained one and is checked the same way: every
request lossless, at each concurrency, and vLLM's AL from its counters within the tolerance of the reference
engine's on the same requests. It accepts rarely (EAGLE-3 pairs the state at t with token t+1 to predict t+2, so
a pass-through drafts a token the target already gave): the demo's trained drafters give the meaningful ALs.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from megatron_osprey.eval.config import DrafterSpec
from megatron_osprey.eval.suites import write_suite
from megatron_osprey.eval.vllm_engine import engine_or_reason
from megatron_osprey.eval.vllm_metrics import AL_TOLERANCE, reference_round_al
from megatron_osprey.models.drafter.reference import DrafterConfig, ReferenceDrafter
from megatron_osprey.stages.evaluate import EvaluateConfig, run
from tests.real_model import PROMPTS, SMOLLM2, SMOLLM2_AUX

REPO = Path(__file__).resolve().parents[2]
# A reduced draft vocabulary, as every EAGLE-3 drafter here trains with: vLLM's Eagle3LlamaForCausalLM has a d2t
# map only then. SmolLM2's byte-level BPE numbers its common tokens first, so the lower half holds most replies.
DRAFT_VOCAB = 24_576
MT_BENCH = (
    (
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
        "must-see attractions.",
        "Rewrite your previous response. Start every sentence with the letter A.",
    ),
    (
        "Draft a professional email seeking your supervisor's feedback on the 'Quarterly Financial Report' you "
        "prepared. Ask specifically about the data analysis, presentation style, and the clarity of conclusions drawn.",
        "Take a moment to evaluate and critique your own response.",
    ),
)


@pytest.fixture(scope="module")
def vllm_python():
    python, reason = engine_or_reason(os.environ.get("VLLM_PYTHON"), {}, REPO)
    if python is None:
        pytest.skip(f"no vLLM engine: {reason}")
    return python


def pass_through_eagle3(target: Path, directory: Path) -> Path:
    """A one-layer EAGLE-3 drafter made of the target's weights: the deepest tap through the target's norm and head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    c = model.config
    cfg = DrafterConfig(
        hidden_size=c.hidden_size,
        target_hidden_size=c.hidden_size,
        num_layers=1,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=DRAFT_VOCAB,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta if hasattr(c, "rope_theta") else c.rope_parameters["rope_theta"],
        aux_layer_ids=list(SMOLLM2_AUX),
        variant="eagle3",
    )
    torch.manual_seed(0)
    drafter = ReferenceDrafter(cfg).eval()
    h = c.hidden_size
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        drafter.lm_head.weight.copy_(model.lm_head.weight[:DRAFT_VOCAB])
        drafter.norm.weight.copy_(model.model.norm.weight)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 2 * h :] = torch.eye(h)
        drafter.layers[0].self_attn.o_proj.weight.zero_()
        drafter.layers[0].mlp.down_proj.weight.zero_()
    drafter.set_draft_vocab(torch.arange(DRAFT_VOCAB))
    drafter.save_pretrained(directory)
    return directory


def test_a_served_drafter_is_lossless_and_its_al_agrees_with_the_reference_engine(vllm_python, tmp_path):
    from megatron_osprey.assets.models import get_model_dir

    target = get_model_dir(SMOLLM2)
    drafter = pass_through_eagle3(target, tmp_path / "drafter")
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": text}]}) + "\n"
            for i, text in enumerate(PROMPTS)
        )
    )
    # MT-Bench questions 81 and 82 (FastChat's question.jsonl), written as `osprey suite` writes the release's form.
    source = tmp_path / "question.jsonl"
    source.write_text("".join(json.dumps({"question_id": 81 + i, "turns": t}) + "\n" for i, t in enumerate(MT_BENCH)))
    write_suite("mtbench", source, tmp_path / "mtbench.jsonl")
    config = EvaluateConfig(
        target=str(target),
        drafters=[DrafterSpec("pass_through", drafter)],
        data=[str(data), str(tmp_path / "mtbench.jsonl")],
        output=str(tmp_path / "eval"),
        max_new_tokens=32,
        verify_lossless=True,
        progress=False,
        engine="vllm",
        vllm_python=vllm_python,
        vllm_concurrency=[1, 3],
    )
    results = run(config)
    section = results["vllm"]
    d = section["drafters"]["pass_through"]
    assert section["engine"]["version"] == "0.32.0" and section["engine"]["enforce_eager"] is True
    assert results["lossless"]["mismatches"] == [] and section["lossless"]["mismatches"] == []
    chat = d["splits"]["chat"]
    assert chat["drafts"] > 0 and len(chat["position_acceptance"]) == 5
    # Both engines drafted and verified every request, and their ALs agree within the tolerance.
    assert chat["accepted_tokens"] <= chat["draft_tokens"] == 5 * chat["drafts"]
    assert abs(d["acceptance_length"] - d["reference_acceptance_length"]) <= AL_TOLERANCE
    assert section["agreement"]["failures"] == []
    assert set(chat["concurrency"]) == {"1", "3"} and chat["concurrency"]["1"]["speedup"] > 0
    # MT-Bench: both turns are requests on both engines (the second after each engine's own first answer), lossless
    # in vLLM at each concurrency, and the AL compared counts both turns' rounds.
    (cell,) = [c for c in results["cells"] if c["split"] == "mtbench"]
    assert [r["id"] for r in cell["requests"]] == ["mtbench/81", "mtbench/82", "mtbench/81#turn2", "mtbench/82#turn2"]
    mtbench = d["splits"]["mtbench"]
    assert mtbench["reference_acceptance_length"] == reference_round_al(cell["requests"])
    assert mtbench["drafts"] > 0 and mtbench["concurrency"]["3"]["in_flight"] == 2
    assert mtbench["concurrency"]["1"]["completion_tokens"] == sum(r["completion_tokens"] for r in cell["requests"])
    assert (Path(config.output) / "vllm.md").read_text().count("| pass_through |") == 3
