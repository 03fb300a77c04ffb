"""The demo's sizes: what `make demo`, `--smoke` and `--cross-tokenizer` select."""

from megatron_osprey.demo.pipeline import DemoConfig, SmallLM


def test_cross_tokenizer_arm_is_added_to_any_size_and_scaled_to_it():
    smoke = DemoConfig.smoke().with_cross_tokenizer()
    assert smoke.cross_tokenizer == SmallLM(iters=5 * DemoConfig.smoke().backbone_iters)
    assert DemoConfig.quick().cross_tokenizer is None
    assert DemoConfig.quick().with_cross_tokenizer().cross_tokenizer.iters == 300
    full = DemoConfig.full()
    assert full.with_cross_tokenizer() is full and full.cross_tokenizer == SmallLM()


def test_quick_keeps_the_paper_protocol_and_holds_out_every_eval_domain():
    quick = DemoConfig.quick()
    assert quick.ttt_steps == 5 and quick.draft_vocab_fraction == 0.25
    assert set(quick.train_domains) < set(quick.eval_domains)  # the rest are out of domain
    assert len(quick.eval_domains) == 5
