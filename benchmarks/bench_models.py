"""The model pairs of `make bench` on the real SmolLM2-135M-Instruct: extraction, greedy and speculative decoding.

Extraction: ours is the extract stage (`stages.extract.run`, aux layers + final, bf16 store), loading the target
each run; the peer is a plain Hugging Face loop (`output_hidden_states=True`, the same chat-templated conversations,
the same micro-batches, the aux layers and the final hidden state cast to bf16 and saved with safetensors), also
loading the model each run; the limit is a bare forward of the loaded target's decoder over the same batches.

Greedy decoding: ours is the eval engine target-only (`BatchedHFTarget` + `batched_target_generate`); the peer is
Hugging Face `generate(do_sample=False)` on the same left-padded batch; both decode exactly max_new_tokens tokens.

Speculative evaluation: ours is the eval's batched engine (`eval.benchmark.run_requests_batched`: every prompt in one
batch, greedy chains of 5); the peer is the eval's batch-1 reference chain decoder (`run_requests`, i.e.
`speculative_generate`) on the same float32 target, drafter and prompts. The drafter is the target pruned to its
first 2 layers and adapted (untrained: acceptance does not matter to the timing, and both sides must emit the same
tokens and verify counts, which the pair checks). No limit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from benchmarks.bench_harness import Pair

TARGET = "smollm2-135m-instruct"


def write_conversations(path: Path, count: int, seed: int = 0, domain: str = "chat") -> Path:
    """The demo's conversations of one domain (chat: its training domain) as conversations JSONL."""
    from megatron_osprey.demo.corpora import domain_conversations, write_jsonl

    return write_jsonl(path, domain_conversations(domain, count, seed=seed))


def _default_aux_ids(layers: int) -> list[int]:
    return [1, layers // 2 - 1, layers - 4]  # the extract stage's default (stages/extract.py)


def _chat_ids(tok, messages: list, add_generation_prompt: bool = False) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tok(text, add_special_tokens=False).input_ids


def _tokenized_batches(target: Path, data: Path, micro_batch: int) -> list[list[list[int]]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    ids = [_chat_ids(tok, r["conversations"]) for r in rows]
    return [ids[i : i + micro_batch] for i in range(0, len(ids), micro_batch)]


def _padded(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, x in enumerate(batch):
        ids[row, : len(x)], mask[row, : len(x)] = torch.tensor(x), 1
    return ids, mask


def hf_extract_loop(target: Path, batches: list, aux_ids: list[int], out: Path) -> Path:
    """The peer: load the model, run each batch with output_hidden_states, save aux + final in bf16 (safetensors)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with torch.no_grad():
        for index, batch in enumerate(batches):
            ids, mask = _padded(batch, 0)
            hidden = model.model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
            tensors = {}
            for row, x in enumerate(batch):
                n = len(x)
                aux = torch.cat([hidden[i + 1][row, :n] for i in aux_ids], dim=-1)
                tensors[f"{index}_{row}_aux"] = aux.to(torch.bfloat16).contiguous()
                tensors[f"{index}_{row}_final"] = hidden[-1][row, :n].to(torch.bfloat16).contiguous()
                tensors[f"{index}_{row}_ids"] = torch.tensor(x)
            save_file(tensors, str(out / f"batch-{index:05d}.safetensors"))
    return out


def extraction_pair(workdir: Path, samples: int, micro_batch: int) -> Pair:
    """The extraction Pair over `samples` chat conversations."""
    from transformers import AutoModelForCausalLM

    from megatron_osprey.assets import get_model_dir
    from megatron_osprey.stages.extract import ExtractConfig, run

    target = get_model_dir(TARGET)
    data = write_conversations(workdir / "chat.jsonl", samples)
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    aux_ids = _default_aux_ids(layers)
    batches = _tokenized_batches(target, data, micro_batch)

    def ours():
        config = ExtractConfig(data_path=str(data), micro_batch_size=micro_batch, overwrite=True)
        config.target.path = str(target)
        config.store.store_dir = str(workdir / "store")
        config.store.encoding = "bf16"
        shutil.rmtree(workdir / "store", ignore_errors=True)
        return run(config)

    model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()

    @torch.no_grad()
    def bare_forward():
        for batch in batches:
            ids, mask = _padded(batch, 0)
            model.model(ids, attention_mask=mask)

    return Pair(
        stage=f"hidden-state extraction ({samples} conversations, batch {micro_batch}, bf16 store)",
        ours=ours,
        # the peer starts from the same conversations file as ours: its tokenization is inside its timed run
        peer=lambda: hf_extract_loop(
            target, _tokenized_batches(target, data, micro_batch), aux_ids, workdir / "hf_store"
        ),
        limit=bare_forward,
        peer_name="a plain HF loop (chat-template tokenization of the same file, output_hidden_states, aux + final "
        "saved in bf16 to safetensors; written here)",
        limit_name="a bare decoder forward of the loaded target over the same batches",
    )


def greedy_pair(prompts: int, new_tokens: int) -> Pair:
    """Target-only greedy decoding of `prompts` chat prompts, batched, `new_tokens` each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_osprey.assets import get_model_dir
    from megatron_osprey.demo.corpora import domain_conversations
    from megatron_osprey.speculative.batched import BatchedHFTarget, batched_target_generate, cache_capacity
    from megatron_osprey.speculative.config import SpecConfig

    target = get_model_dir(TARGET)
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    rows = domain_conversations("chat", prompts, seed=1)
    ids = []
    for r in rows:
        ids.append(torch.tensor(_chat_ids(tok, r["conversations"][:1], add_generation_prompt=True)))
    aux_ids = _default_aux_ids(model.config.num_hidden_layers)

    def ours():
        capacity = cache_capacity(ids, SpecConfig(max_new_tokens=new_tokens), 1)
        return batched_target_generate(BatchedHFTarget(model, aux_ids, capacity), ids, new_tokens)

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    width = max(len(x) for x in ids)
    batch = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, x in enumerate(ids):  # left padding, as generate expects for decoder-only models
        batch[row, width - len(x) :], mask[row, width - len(x) :] = x, 1

    @torch.no_grad()
    def peer():
        out = model.generate(
            batch,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )
        return [row[width:].tolist() for row in out]

    def check(ours_out, peer_out):
        same = sum(a == b for a, b in zip(ours_out, peer_out))
        if same < len(ours_out) / 2:  # float32 ties can flip a late token; most rows must agree exactly
            raise AssertionError(f"greedy decoding: only {same} of {len(ours_out)} rows equal HF generate's.")

    return Pair(
        stage=f"greedy target decoding ({prompts} prompts batched, {new_tokens} tokens)",
        ours=ours,
        peer=peer,
        peer_name="Hugging Face generate(do_sample=False), the same left-padded batch",
        check=check,
    )


def adapted_drafter(directory: Path, target: Path) -> Path:
    """An Osprey drafter of the target's own family: the target pruned to its first 2 layers (the prune stage),
    adapted to it (the adapt stage), untrained. Built once per bench run: the distillation and speculative pairs
    share it."""
    from megatron_osprey.stages import adapt, prune
    from megatron_osprey.stages.adapt import AdaptConfig
    from megatron_osprey.stages.prune import PruneConfig

    drafter = directory / "drafter"
    if (drafter / "run_config.yaml").is_file():
        return drafter
    directory.mkdir(parents=True, exist_ok=True)
    backbone = directory / "backbone"
    prune.run(PruneConfig(source=str(target), output=str(backbone), num_layers=2, overwrite=True))
    adapt.run(AdaptConfig(backbone=str(backbone), target=str(target), output=str(drafter), overwrite=True))
    shutil.rmtree(backbone, ignore_errors=True)
    return drafter


def speculative_pair(target: Path, drafter: Path, prompts: int, new_tokens: int, steps: int = 5) -> Pair:
    """Greedy chain speculative decoding of `prompts` chat prompts, `new_tokens` each: the eval's batched engine
    (all prompts in one batch) against its batch-1 reference engine, the same float32 target and drafter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_osprey.demo.corpora import domain_conversations
    from megatron_osprey.eval import benchmark
    from megatron_osprey.eval.loading import load_drafter
    from megatron_osprey.eval.prompts import EvalPrompt
    from megatron_osprey.speculative import HFTargetModel, SpecConfig

    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    reference = load_drafter(drafter).drafter.to(torch.float32)
    rows = domain_conversations("chat", prompts, seed=1)
    requests = [
        EvalPrompt(f"chat-{i}", torch.tensor(_chat_ids(tok, r["conversations"][:1], add_generation_prompt=True)))
        for i, r in enumerate(rows)
    ]
    spec = SpecConfig(steps=steps, topk=1, max_new_tokens=new_tokens)  # no EOS: every request decodes new_tokens
    aux = list(reference.config.aux_layer_ids)

    def ours():
        return benchmark.run_requests_batched(model, reference, requests, spec, batch_size=len(requests))

    def peer():
        session = benchmark.make_session(reference, model.config.vocab_size)
        return benchmark.run_requests(HFTargetModel(model, aux), session, requests, spec)

    def check(ours_out, peer_out):
        for a, b in zip(ours_out, peer_out):
            at = benchmark.first_mismatch(a.output_ids, b.output_ids)
            if at is not None or a.verify_count != b.verify_count:
                raise AssertionError(
                    f"speculative decoding: request {a.id} differs between the batched engine and the batch-1 "
                    f"reference engine (first token mismatch at {at}; {a.verify_count} vs {b.verify_count} verifies)."
                )

    return Pair(
        stage=f"speculative evaluation ({prompts} prompts batched, {new_tokens} tokens, chain of {steps})",
        ours=ours,
        peer=peer,
        peer_name="the reference chain decoder at batch 1 (speculative_generate), the same drafter and prompts",
        check=check,
    )
