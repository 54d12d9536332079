"""FID-family metrics against closed forms, and the offline digits extractor."""

import numpy as np
import pytest
import torch

from mhla_gen.metrics.extractors import digits_extractor, extract_features, inception_extractor
from mhla_gen.metrics.fid import (
    feature_statistics,
    fid_from_features,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    load_reference_stats,
    precision_recall,
    save_reference_stats,
)


@pytest.fixture(scope="module")
def extractor():
    # the default cache (~/.cache/mhla_gen or $MHLA_GEN_CACHE): trained once per machine, a few seconds
    return digits_extractor()


def test_frechet_equal_covariances_is_squared_mean_distance():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(5, 5))
    sigma = a @ a.T + np.eye(5)
    mu1, mu2 = rng.normal(size=5), rng.normal(size=5)
    assert frechet_distance(mu1, sigma, mu2, sigma) == pytest.approx(((mu1 - mu2) ** 2).sum(), rel=1e-6)


def test_frechet_diagonal_closed_form():
    var1, var2 = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 1.0])
    mu1, mu2 = np.zeros(3), np.array([1.0, 0.0, 2.0])
    expected = 5.0 + ((np.sqrt(var1) - np.sqrt(var2)) ** 2).sum()
    assert frechet_distance(mu1, np.diag(var1), mu2, np.diag(var2)) == pytest.approx(expected, rel=1e-6)


def test_frechet_rejects_mismatched_sizes():
    with pytest.raises(ValueError, match="differ in size"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))


def test_fid_of_a_set_with_itself_is_zero_and_grows_with_shift():
    x = np.random.default_rng(1).normal(size=(500, 8))
    # float64: tr(2C - 2 sqrtm(C C)) is off by ~ eps64 x cond(C) x ||C||, ~1e-14 for this 8x8 covariance
    assert abs(fid_from_features(x, x)) < 1e-12
    assert fid_from_features(x, x + 1.0) == pytest.approx(8.0, rel=1e-6)  # shift only moves the mean


def test_kid_unbiased_near_zero_on_identical_distributions():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(400, 16)), rng.normal(size=(400, 16))
    kid_same, std_same = kernel_inception_distance(x, y, num_subsets=20, subset_size=200)
    kid_shift, _ = kernel_inception_distance(x, y + 0.5, num_subsets=20, subset_size=200)
    assert abs(kid_same) < 3 * std_same + 1e-3  # unbiased: fluctuates around 0, may be negative
    assert kid_shift > 10 * max(abs(kid_same), 1e-4)


def test_kid_is_the_unbiased_polynomial_mmd_closed_form():
    """One subset holding every row: KID is exactly the unbiased MMD² with k(a, b) = (aᵀb / F + 1)³."""
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(20, 4)), rng.normal(size=(20, 4)) + 0.3
    k = lambda a, b: (a @ b.T / 4 + 1) ** 3
    m = len(x)
    within = (k(x, x).sum() - np.trace(k(x, x)) + k(y, y).sum() - np.trace(k(y, y))) / (m * (m - 1))
    expected = within - 2 * k(x, y).sum() / m**2
    kid, std = kernel_inception_distance(x, y, num_subsets=1, subset_size=m)
    assert kid == pytest.approx(expected, rel=1e-10) and std == 0.0
    # reproducible subsets, the global RNG left as it was
    state = torch.get_rng_state()
    assert kernel_inception_distance(x, y, 5, 10, seed=3) == kernel_inception_distance(x, y, 5, 10, seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_frechet_distance_with_a_dead_feature_is_quiet_and_unchanged():
    """A zero-variance feature (a ReLU unit that never fires) makes the covariances singular: no
    LinAlgWarning, and the distance equals the one without that feature."""
    import warnings

    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(300, 5)), rng.normal(size=(300, 5)) * 1.5 + 0.2
    dead = lambda a: np.concatenate([a, np.zeros((len(a), 2))], axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_dead = fid_from_features(dead(x), dead(y))
    assert with_dead == pytest.approx(fid_from_features(x, y), rel=1e-6)


def test_precision_recall_identical_vs_separated_clouds():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(300, 4)), rng.normal(size=(300, 4))
    p, r = precision_recall(x, y)
    assert p > 0.8 and r > 0.8
    p, r = precision_recall(x, y + 20.0)
    assert p == 0.0 and r == 0.0
    # a fake set collapsed onto part of the real manifold: high precision, low recall
    p, r = precision_recall(x, x[x[:, 0] > 1.0] + 1e-3)
    assert p > 0.9 and r < 0.5


def test_inception_score_uniform_and_one_hot():
    assert inception_score(torch.zeros(100, 10), splits=2)[0] == pytest.approx(1.0, abs=1e-9)
    one_hot = 50.0 * torch.eye(10).repeat(10, 1)  # confident, every class equally often
    assert inception_score(one_hot, splits=1)[0] == pytest.approx(10.0, rel=1e-6)


def test_reference_stats_roundtrip(tmp_path):
    feats = {"pool": np.random.default_rng(4).normal(size=(50, 6)),
             "spatial": np.random.default_rng(5).normal(size=(50, 12))}
    save_reference_stats(tmp_path / "ref.npz", feats, "test-extractor")
    ref = load_reference_stats(tmp_path / "ref.npz")
    mu, sigma = feature_statistics(feats["pool"])
    np.testing.assert_allclose(ref["mu"], mu)
    np.testing.assert_allclose(ref["sigma"], sigma)
    assert ref["sigma_s"].shape == (12, 12) and str(ref["extractor"]) == "test-extractor"
    np.savez(tmp_path / "bad.npz", arr_0=np.zeros((2, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="no 'mu'"):
        load_reference_stats(tmp_path / "bad.npz")


def test_digits_extractor_is_accurate_cached_and_shape_agnostic(extractor, tmp_path):
    from mhla_gen.data.digits import digits_tensors

    assert extractor.test_accuracy > 0.9
    images, _ = digits_tensors(16)
    rgb32 = torch.nn.functional.interpolate(images[:8], size=32, mode="bilinear").expand(-1, 3, -1, -1)
    feats = extractor(rgb32)
    assert feats["pool"].shape == (8, 64) and feats["logits"].shape == (8, 10)
    assert feats["spatial"].shape == (8, 256)
    # reloading from the cache gives the same network
    from safetensors.torch import save_file

    save_file(extractor.state_dict(), str(tmp_path / "copy.safetensors"), metadata={"test_accuracy": "0.5"})
    again = digits_extractor(tmp_path / "copy.safetensors")
    assert again.test_accuracy == 0.5
    torch.testing.assert_close(again(images[:4])["pool"], extractor(images[:4])["pool"])


def test_digits_cnn_training_learns_quickly():
    from mhla_gen.metrics.extractors import train_digits_cnn

    _, accuracy = train_digits_cnn(seed=1, epochs=1)
    assert accuracy > 0.5  # chance is 0.1; the cached 12-epoch model reaches > 0.9 (checked above)


def test_digits_fid_separates_real_from_noise(extractor):
    from mhla_gen.data.digits import digits_tensors

    images, _ = digits_tensors(16)
    a, b = extract_features(extractor, images[:600]), extract_features(extractor, images[600:1200])
    noise = extract_features(extractor, torch.rand(600, 1, 16, 16))
    assert fid_from_features(a["pool"], b["pool"]) * 10 < fid_from_features(a["pool"], noise["pool"])


def test_inception_extractor_missing_file_says_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="inception-2015-12-05.pt"):
        inception_extractor(tmp_path / "nope.pt")


def test_cached_cnn_trains_the_same_weights_whatever_the_thread_count(tmp_path):
    """The extractor a cache holds is one function: trained on one thread whatever torch's thread count
    (CPU kernels split their sums by threads: on 2 threads the weights differ), and the caller's count is
    restored."""
    from safetensors.torch import load_file

    from mhla_gen.metrics.extractors import DigitsCNN, cached_cnn, train_digits_cnn

    def short(seed):
        return train_digits_cnn(seed, epochs=1)

    weights = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            cached_cnn(DigitsCNN, short, "digits", tmp_path / f"t{threads}.safetensors", seed=0)
            assert torch.get_num_threads() == threads
        finally:
            torch.set_num_threads(1)
        weights[threads] = load_file(str(tmp_path / f"t{threads}.safetensors"))
    for name, tensor in weights[1].items():
        assert torch.equal(tensor, weights[2][name]), name
