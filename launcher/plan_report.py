"""How `osprey plan` reports: the plan's lines, a trained stage's budget and schedule, and the commands that build a
recipe's inputs (its `osprey data` input rule, its benchmark eval sets); torch-free."""

from __future__ import annotations

from megatron_osprey.base.memory import GIB
from megatron_osprey.recipes.recipe import Recipe


def plan_lines(plan) -> list[str]:
    """A Plan as the human-readable report, one fact per line."""
    out = [
        f"recipe   {plan.recipe} (stage {plan.stage}, {plan.hardware}, {plan.precision})",
        f"world    {plan.nodes} node(s) x {plan.gpus_per_node} process(es) per node = {plan.world_size} ranks; "
        f"data parallel {plan.data_parallel_size}",
    ]
    if plan.cpu:
        out.append(f"hardware {plan.cpu}")
    if plan.target:
        t = plan.target
        out.append(
            f"target   {t['model_type']} from {t['source']}: {t['num_layers']} layers, hidden {t['hidden_size']}, "
            f"vocab {t['vocab_size']:,}; aux layers {t['aux_layer_ids']}"
        )
    out += [f"check    {c}" for c in plan.checks]
    if plan.memory:
        parts = " + ".join(f"{name} {b / GIB:.2f}" for name, b in plan.memory)
        budget = f" of {plan.gpu_memory_gib:g} GiB ({plan.hardware.upper()})" if plan.gpu_memory_gib else ""
        out.append(f"memory   per GPU (GiB): {parts} = {plan.memory_bytes / GIB:.2f} GiB{budget}")
    if plan.train_iters:
        out.append(f"steps    {plan.train_iters:,} iterations; {plan.tokens:,} tokens ({plan.tokens / 1e9:.2f}B)")
        out.append(f"budget   {plan.budget}")
    out += input_lines(plan.schedule, plan.data_rule, plan.eval_suites)
    out += [f"disk     {name}: {_size(b)}" for name, b in plan.disk]
    return out


def _size(num_bytes: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def training_budget(recipe_budget: str, training, optimizer) -> tuple[str, dict]:
    """(the plan's budget line, the learning-rate schedule) of a trained stage."""
    iters, gbs, seq = training.num_train_iters(), training.global_batch_size, training.seq_length
    budget = (
        f"{recipe_budget}; global batch {gbs} x seq {seq:,} = {gbs * seq:,} tokens per step at most; "
        f"lr {optimizer.lr:g}, warmup {optimizer.warmup_iters(iters):,} iterations, clip {optimizer.clip_grad:g}, "
        f"Adam betas ({optimizer.adam_beta1:g}, {optimizer.adam_beta2:g})"
    )
    return budget, optimizer.schedule(iters)


def input_lines(schedule: dict | None, rule: dict | None, suites: dict | None) -> list[str]:
    """The plan's schedule, input-rule and eval-set lines."""
    out = []
    if schedule:
        sc = schedule
        stop = "" if sc["stop_iter"] == sc["decay_iters"] else f", stopped at iteration {sc['stop_iter']:,}"
        out.append(
            f"schedule {sc['decay_style']} from lr {sc['peak_lr']:g} to {sc['min_lr']:g} over "
            f"{sc['decay_iters']:,} iterations after {sc['warmup_iters']:,} of warmup{stop}; "
            f"final lr {sc['final_lr']:.4g} ({sc['final_lr_share_of_peak']:.1%} of the peak)"
        )
    if rule:
        out.append(f"inputs   built by: {rule['command']}")
    for name, suite in (suites or {}).items():
        out.append(f"eval set {name}: {suite['prompts']} prompts, written by: {suite['command']}")
    return out


def data_rule(recipe: Recipe) -> dict | None:
    """The recipe's input rule (recipe.data) and the `osprey data` command that applies it to a source file."""
    rule = recipe.data
    if rule is None:
        return None
    domain = recipe.domain or "all"
    output = recipe.path("prompts").rsplit("/prompts/", 1)[0]
    flags = f"--split-rule {rule.split_rule} --seed {rule.seed} --eval-size {rule.eval_size}"
    flags += f" --max-train {rule.max_train}" if rule.max_train is not None else ""
    command = (
        f"osprey data --input {domain}=SOURCE_OF_{domain.upper()} --target {recipe.path('target')} --output {output} "
        f"{flags}"
    )
    fields = ("split_rule", "seed", "max_train", "eval_size", "prompt_turns")
    return {**{key: getattr(rule, key) for key in fields}, "command": command}


# The suites a pinned registry package ships (`osprey suite --source package`); every other one reads a file or
# directory the user downloads first (nothing is fetched from a hub here).
OFFLINE_SUITES = ("humaneval",)


def eval_suite_commands(recipe: Recipe) -> dict:
    """{eval set: {prompts, offline, command}}: the `osprey suite` command that writes each of the recipe's benchmark
    eval sets at its paths.eval_data, holding exactly the prompts the release evaluates."""
    out = {}
    for name, prompts in recipe.eval_suites.items():
        offline = name in OFFLINE_SUITES
        source = "package" if offline else f"SOURCE_OF_{name.upper()}"
        output = recipe.path("eval_data", name)
        out[name] = {
            "prompts": prompts,
            "offline": offline,
            "command": f"osprey suite --suite {name} --source {source} --limit {prompts} --output {output}",
        }
    return out
