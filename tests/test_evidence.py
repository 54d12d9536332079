"""Evidence that decides: the shapes data and its exact scores, the validation loss, the FID's own noise,
minimum detectable differences and verdicts, and stage 1's end-to-end number."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.data.shapes import class_colour, class_count, shapes_tensors
from mhla_gen.evidence import compare, detectable, fid_bootstrap, min_effect, paired_bootstrap, verdict
from mhla_gen.metrics.shapes import property_scores
from mhla_gen.testing import tiny_dit
from mhla_gen.transfer import TransferHooks, end_to_end_errors, finalize, relative_error
from mhla_gen.validation_loss import bucket_means, triple_losses, validation_set


# ------------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("resolution", [32, 64])
def test_shapes_are_deterministic_and_score_exactly_on_every_property(resolution):
    images, labels = shapes_tensors(resolution, 60, seed=3)
    again, _ = shapes_tensors(resolution, 60, seed=3)
    assert torch.equal(images, again) and images.shape == (60, 3, resolution, resolution)
    assert not torch.equal(images, shapes_tensors(resolution, 60, seed=4)[0])
    assert torch.equal(images, images.flip(-1))  # mirror-symmetric, exactly
    scores = property_scores(images, labels)
    for key in ("symmetric", "count", "colour", "all"):
        assert scores[key].all(), key
    assert (scores["symmetry_error"] == 0).all()
    fg = images.amax(1) > 0.5  # every foreground pixel has the class colour
    for i in range(10):
        assert torch.equal(images[i][:, fg[i]].T.unique(dim=0), torch.from_numpy(class_colour(i))[None])


def test_each_property_fails_when_its_content_is_broken():
    images, labels = shapes_tensors(32, 30, seed=5)
    half = images.clone()
    half[..., 16:] = 0  # the right half gone: neither symmetric nor the right count
    s = property_scores(half, labels)
    assert not s["symmetric"].any() and not s["count"].any() and s["colour"].all()
    recoloured = images[:, [1, 2, 0]]  # channels rotated: a hue 120 degrees away
    assert not property_scores(recoloured, labels)["colour"].any()
    wrong = (labels + 1) % 10  # another count, except 9 -> 0 (both 1 + c % 3 = 1)
    same = np.array([class_count(int(a)) == class_count(int(b)) for a, b in zip(labels, wrong)])
    assert np.array_equal(property_scores(images, wrong)["count"], same) and same.mean() < 0.2
    assert [2 * class_count(c) for c in range(4)] == [2, 4, 6, 2]


# ----------------------------------------------------------------------------------- validation loss
def _model():
    torch.manual_seed(0)
    model = tiny_dit(num_layers=1).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_validation_loss_is_deterministic_stratified_and_the_plain_formula():
    model, scheduler = _model(), DDPMScheduler(num_train_timesteps=1000)
    size, channels = model.config.sample_size, model.config.in_channels
    images, labels = torch.rand(10, channels, size, size), torch.arange(10) % 4
    vset = validation_set(images, labels, 40, 1000)
    again = validation_set(images, labels, 40, 1000)
    assert all(torch.equal(vset[k], again[k]) for k in vset)
    assert all(i * 25 <= t < (i + 1) * 25 for i, t in enumerate(vset["t"].tolist()))  # one per slice
    losses = triple_losses(model, scheduler, vset, batch_size=7)
    assert np.array_equal(losses, triple_losses(model, scheduler, vset, batch_size=7))  # bit-identical
    # another batching sums in another order: float32 rounding only (a few eps of the loss)
    np.testing.assert_allclose(losses, triple_losses(model, scheduler, vset, batch_size=40), rtol=1e-5)
    i = 13  # one triple by hand
    xt = scheduler.add_noise(vset["x0"][i:i + 1], vset["noise"][i:i + 1], vset["t"][i:i + 1])
    with torch.no_grad():
        out = model(xt, timestep=vset["t"][i:i + 1], class_labels=vset["labels"][i:i + 1]).sample
    want = (out[:, :channels] - vset["noise"][i:i + 1]).square().mean().item()
    assert losses[i] == pytest.approx(want, rel=1e-5)
    means = bucket_means(losses, 4)
    assert means["val_loss_b0"] == pytest.approx(losses[:10].mean())
    assert means["val_loss"] == pytest.approx(np.mean([losses[k * 10:(k + 1) * 10].mean() for k in range(4)]))


# ---------------------------------------------------------------------------------- noise and verdicts
def test_bootstraps_detectable_differences_and_verdicts():
    rng = np.random.default_rng(0)
    real, fake = rng.normal(size=(400, 4)), rng.normal(0.3, 1.0, size=(200, 4))
    assert fid_bootstrap(real, fake, draws=30)["sd"] > 0
    same = paired_bootstrap(real, fake, fake.copy(), draws=10)
    assert same["difference"] == 0 and same["sd"] == 0  # the same samples: no sampling noise left
    from scipy import stats

    want = (stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * 2 / math.sqrt(5)
    assert detectable(2.0, 5) == pytest.approx(want)
    assert detectable(1.0, 1) == pytest.approx(1.959964 + 0.841621, rel=1e-5)
    assert verdict(-3.0, 1.0, 0.5) == "resolved" and verdict(0.1, 0.2, 0.5) == "bounded"
    assert verdict(0.1, 2.0, 0.5) == "undecided" and verdict(math.nan, 1.0, 1.0) == "undecided"
    records = [{"arm": a, "seed": s, "step": 5, "fid": v} for a, vals in
               {"x": [10.0, 11.0, 12.0], "y": [20.0, 20.5, 22.5]}.items() for s, v in enumerate(vals)]
    c = compare(records, "x", "y", "fid", 5)
    assert c["per_seed"] == {0: -10.0, 1: -9.5, 2: -10.5} and c["verdict"] == "resolved"
    assert c["min_effect"] == pytest.approx(0.1 * 21.0)
    assert min_effect("val_loss_b2", 0.5) == pytest.approx(0.02 * 0.5)  # a bucket: the validation loss's


def test_a_rates_interval_is_never_narrower_than_its_own_sampling_noise():
    """Two seeds with the same difference of a rate (3 samples in 300) give a t half-width of 0: the
    verdict must not call that resolved (it is bounded: inside the 0.05 minimum effect); on 100 000 samples
    per score the same difference is."""
    def records(samples):
        return [{"arm": a, "seed": s, "step": 1, "colour_accuracy": v, "fid_samples": samples}
                for a, v in (("cpe", 0.98), ("plain", 0.99)) for s in (0, 1)]

    few = compare(records(300), "cpe", "plain", "colour_accuracy", 1)
    assert few["per_seed"] == {0: pytest.approx(-0.01), 1: pytest.approx(-0.01)}
    assert few["verdict"] == "bounded"
    floor = 1.959964 * math.sqrt((0.98 * 0.02 + 0.99 * 0.01) / 300) / math.sqrt(2)
    assert few["ci"] == pytest.approx(floor) and few["mdd"] > 0
    assert compare(records(100_000), "cpe", "plain", "colour_accuracy", 1)["verdict"] == "resolved"


def test_a_fids_interval_is_never_narrower_than_its_known_sampling_noise():
    """Two seeds whose FID differences agree to 1 (+129, +130) resolve on their t-interval alone; with the
    paired bootstrap spread of one sample set (160) the interval is at least 1.96 * 160 / sqrt(2)."""
    records = [{"arm": a, "seed": s, "step": 1, "fid": v}
               for a, vals in (("uniform", (537.0, 1077.0)), ("plain", (408.0, 947.0))) for s, v in
               enumerate(vals)]
    assert compare(records, "uniform", "plain", "fid", 1)["verdict"] == "resolved"
    noisy = compare(records, "uniform", "plain", "fid", 1, sampling_sd=160.0)
    assert noisy["ci"] == pytest.approx(1.959964 * 160 / math.sqrt(2)) and noisy["verdict"] == "undecided"
    assert noisy["mdd"] >= detectable(160.0, 2)
    assert compare(records, "uniform", "plain", "fid", 1, sampling_sd=1.0)["verdict"] == "resolved"


# ------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("trainable", ["mhla", "all"])
def test_end_to_end_errors_equal_the_finalized_models_output_error(trainable):
    """The hooked measurement of the converted model (and of each one-softmax-layer hybrid) equals the
    output error of the model finalize() makes, against the stock model (the teacher). With trained
    projections (``all``), a layer put back to softmax is the teacher's layer again, weights included."""
    model = tiny_dit(num_layers=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    teacher = copy.deepcopy(model).eval()
    x = torch.randn(2, model.config.in_channels, model.config.sample_size, model.config.sample_size)
    batch = dict(hidden_states=x, timestep=torch.tensor([10, 20]), class_labels=torch.tensor([1, 2]))
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    hooks = TransferHooks(model.eval(), trainable)
    with torch.no_grad():  # stage 1 moved what it trains
        for p in hooks.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    got = end_to_end_errors(model, hooks, [batch], chosen=[0, 2])
    with torch.no_grad():
        want_teacher = teacher(**batch).sample

        def finalized(softmax):
            m = copy.deepcopy(model)
            for module in m.modules():  # the copy without the transfer hooks
                module._forward_hooks.clear()
                module._forward_hooks_with_kwargs.clear()
            final = finalize(m, softmax, hooks.teachers)
            for i in softmax:
                stock, kept = teacher.transformer_blocks[i].attn1, final.transformer_blocks[i].attn1
                assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(),
                                                             kept.state_dict().values()))
            return relative_error(final(**batch).sample, want_teacher).item()

        assert got["all_mhla"] == pytest.approx(finalized([]), rel=1e-4)
        for i in range(3):
            assert got["keep_softmax"][i] == pytest.approx(finalized([i]), rel=1e-4)
        assert got["chosen"] == pytest.approx(finalized([0, 2]), rel=1e-4)
        assert got["all_mhla"] > 0
