"""The demo's pipeline end to end at the smallest size: every entry point, in order, on CPU."""

import json

import pytest

from megatron_osprey.demo.pipeline import MARKER, DemoConfig, run_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    output = tmp_path_factory.mktemp("demo")
    cfg = DemoConfig.smoke()
    return output, cfg, run_demo(cfg, output)


def test_report_holds_both_methods_and_the_matrix(demo):
    output, cfg, report = demo
    on_disk = json.loads((output / "report.json").read_text())
    assert on_disk["methods"].keys() == {"osprey", "eagle3"}
    for method in ("osprey", "eagle3"):
        matrix = on_disk["matrix"][method]
        assert matrix["train_domains"] == list(cfg.train_domains)
        assert matrix["eval_domains"] == list(cfg.eval_domains)
        row = matrix["acceptance_length"][0]
        assert len(row) == 2 and all(1.0 <= v <= 6.0 for v in row)  # 1 <= AL <= draft tokens
        stats = on_disk["methods"][method]
        assert stats["id_cells"] == 1 and stats["ood_cells"] == 1
    assert set(on_disk["osprey_gain_over_eagle3"]) == {"mean", "id", "ood"}
    assert (output / "heatmap.png").stat().st_size > 1000
    assert "| osprey |" in (output / "report.md").read_text()


def test_every_stage_ran_through_its_entry_point(demo):
    output, _, report = demo
    logs = sorted(p.name for p in (output / "logs").iterdir())
    for step in ("train_target", "prune", "pretrain_backbone", "adapt", "regenerate_chat",
                 "distill_osprey_chat", "distill_eagle3_chat", "eval"):
        assert any(step in name for name in logs), step
    assert (output / "backbone" / "hf" / "config.json").is_file()  # Stage 2 left the Stage 3 layout
    assert (output / "drafter_init" / "tokenizer_alignment.json").is_file()
    assert (output / MARKER).is_file()
    regenerated = (output / "data" / "chat_regenerated.jsonl").read_text().splitlines()
    assert len(regenerated) == 12


def test_refuses_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "precious.txt").write_text("keep")
    with pytest.raises(RuntimeError, match="was not written by the demo"):
        run_demo(DemoConfig.smoke(), tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep"
