"""The moving-shapes video data set (data/moving_shapes.py) and its exact per-frame scorer
(metrics/moving_shapes.py): the data obey their law and score perfectly; broken clips are flagged in the
frames where they break."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from mhla_gen.data import moving_shapes as ms
from mhla_gen.data.shapes import class_colour
from mhla_gen.metrics.moving_shapes import clip_scores, frame_curves, score_summary

SIZES = [(13, 64, 64), (17, 32, 32), (9, 32, 48)]  # (frames, height, width)


def _reflected(start, velocity, low, high, frames):
    """The bounce law step by step (independent of ``ms.bounce``'s closed form)."""
    x, v, out = start, velocity, []
    for _ in range(frames):
        out.append(x)
        x += v
        if x > high:
            x, v = 2 * high - x, -v
        if x < low:
            x, v = 2 * low - x, -v
    return out


@pytest.mark.parametrize("start, velocity, low, high", [(5, 3, 2, 12), (12, -3, 2, 12), (4, 1, 4, 5),
                                                        (7, -2, 3, 29), (3, 2, 3, 3)])
def test_bounce_is_reflection_at_the_borders(start, velocity, low, high):
    if high == low:
        velocity = 0  # a shape as wide as the frame cannot move
    assert ms.bounce(start, velocity, low, high, 40).tolist() == _reflected(start, velocity, low, high, 40)


@pytest.mark.parametrize("frames, height, width", SIZES)
def test_clips_obey_the_law_and_score_perfectly(frames, height, width):
    videos, labels = ms.moving_shapes_tensors(frames, height, width, 40, seed=3)
    assert videos.shape == (40, 3, frames, height, width) and labels.tolist() == [i % 10 for i in range(40)]
    for clip, c in zip(videos.numpy(), labels.tolist()):
        drawn = clip.max(axis=0) > 0  # (F, H, W)
        assert np.array_equal(clip[:, drawn].T, np.broadcast_to(class_colour(c), (drawn.sum(), 3)))
        counts = [ndimage.label(m, structure=np.ones((3, 3)))[1] for m in drawn]
        assert counts == [ms.class_count(c)] * frames
        assert not (drawn[0] == drawn[1]).all()  # it moves
    scores = clip_scores(videos, labels)
    for name in ("count", "colour", "motion", "all"):
        assert scores[name].all(), name
    assert (scores["position_error"] == 0).all()
    assert all((curve == 1).all() for curve in frame_curves(scores).values())
    assert score_summary(videos, labels)["clips_all_correct"] == 1.0


def test_clips_are_deterministic_and_drawn_one_by_one():
    videos, labels = ms.moving_shapes_tensors(9, 32, 32, 12, seed=5)
    again, _ = ms.moving_shapes_tensors(9, 32, 32, 12, seed=5)
    assert torch.equal(videos, again)
    assert not torch.equal(videos, ms.moving_shapes_tensors(9, 32, 32, 12, seed=6)[0])
    clip, c = ms.moving_shapes_clip(11, 9, 32, 32, seed=5)
    assert np.array_equal(clip, videos[11].numpy()) and c == labels[11] == 1
    data = ms.MovingShapesVideos(9, 32, 32, count=12, seed=5)
    item = data[11]
    assert len(data) == 12 and item["caption"] == "two orange shapes moving" and item["class_labels"] == 1
    assert torch.equal(item["pixels"], videos[11] * 2 - 1) and len(set(data.paths)) == 12
    # the class table, literally: class c holds 1 + c % 3 shapes, said in its caption
    shapes = [ndimage.label(clip[:, 0].max(axis=0) > 0)[1] for clip in videos.numpy()[:10]]
    assert shapes == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    assert [ms.class_caption(c) for c in (0, 2, 9)] == ["one red shape moving", "three lime shapes moving",
                                                        "one pink shape moving"]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="data.num_frames must be >= 2 .* got 1"):
        ms.MovingShapesVideos(1, 32, 32)
    with pytest.raises(ValueError, match="data.width must be >= 32 pixels for moving shapes, got 16"):
        ms.moving_shapes_tensors(9, 32, 16, 4)


# ------------------------------------------------------------------------------ broken clips are flagged
def _clip(c=1, frames=9, size=32):
    videos, labels = ms.moving_shapes_tensors(frames, size, size, 10, seed=7)
    return videos[c : c + 1].clone(), labels[c : c + 1]


def _one_shape(video, frame):
    """Bool mask ``(H, W)`` of one shape in ``frame`` and the others' mask."""
    labelled, _ = ndimage.label(video[0, :, frame].amax(0).numpy() > 0, structure=np.ones((3, 3)))
    return torch.from_numpy(labelled == 1), torch.from_numpy(labelled > 1)


def _flagged(scores, name):
    return np.flatnonzero(~scores[name][0]).tolist()


def test_a_static_clip_is_flagged_in_every_frame():
    video, labels = _clip()
    static = video[:, :, :1].expand_as(video)
    scores = clip_scores(static, labels)
    assert scores["count"].all() and scores["colour"].all()
    assert _flagged(scores, "motion") == list(range(9)) and not scores["all"].any()


def test_a_shape_that_teleports_is_flagged_from_then_on():
    """A disc on its track up to frame 4, then 12 rows lower on a parallel one."""
    colour = class_colour(0)
    before, after = (torch.from_numpy(ms.render([ms.Track(4, True, (row, 8), (1, 2))], colour, 9, 32, 32))
                     for row in (10, 22))
    jumped = torch.cat([before[:, :5], after[:, 5:]], dim=1)[None]
    assert clip_scores(before[None], [0])["all"].all()
    scores = clip_scores(jumped, [0])
    assert _flagged(scores, "motion") == [5, 6, 7, 8] and scores["count"].all() and scores["colour"].all()
    assert scores["position_error"][0, 5] == 12


def test_a_shape_that_changes_colour_is_flagged_in_that_frame():
    video, labels = _clip()
    shape, _ = _one_shape(video, 4)
    recoloured = video.clone()
    recoloured[0, :, 4, shape] = torch.from_numpy(class_colour(6))[:, None]
    scores = clip_scores(recoloured, labels)
    assert _flagged(scores, "colour") == [4] and scores["count"].all() and scores["motion"].all()


def test_a_shape_that_splits_or_vanishes_is_flagged_in_that_frame():
    video, labels = _clip(c=3)  # one large shape (radius 3 or 4 at 32 px)
    shape, _ = _one_shape(video, 6)
    rows = shape.any(dim=1).nonzero().squeeze(1)
    split = video.clone()
    split[0, :, 6, rows[len(rows) // 2]] = 0  # a blank row through the shape's middle
    vanished = video.clone()
    vanished[0, :, 6, shape] = 0
    for broken in (split, vanished):
        scores = clip_scores(broken, labels)
        assert _flagged(scores, "count") == [6] and _flagged(scores, "motion") == [6]
        assert _flagged(scores, "all") == [6]


def test_a_shape_that_does_not_bounce_is_flagged():
    """One square moving right at 3 px a frame from column 19 of 32 (radius 3): the law reflects it at
    column 28 (frame 3); one that sticks to the border instead is wrong from frame 4 on."""
    track = ms.Track(3, False, (10, 19), (0, 3))
    colour = class_colour(0)
    lawful = torch.from_numpy(ms.render([track], colour, 8, 32, 32))[None]
    assert clip_scores(lawful, [0])["all"].all()
    sticky = torch.zeros_like(lawful)
    for f in range(8):
        col = min(19 + 3 * f, 28)
        sticky[0, :, f, 7:14, col - 3 : col + 4] = torch.from_numpy(colour)[:, None, None]
    assert _flagged(clip_scores(sticky, [0]), "motion") == [4, 5, 6, 7]


def test_a_wrong_label_fails_colour_and_count():
    video, labels = _clip(c=1)  # two orange shapes
    scores = clip_scores(video, [5])  # three cyan ones
    assert not scores["colour"].any() and not scores["count"].any() and scores["motion"].all()


def test_scores_survive_a_little_blur_and_noise():
    """A sample is never pixel-exact: a mild blur and noise keep every check (64 px, tolerance 3 px)."""
    videos, labels = ms.moving_shapes_tensors(9, 64, 64, 10, seed=8)
    blurred = torch.from_numpy(ndimage.gaussian_filter(videos.numpy(), sigma=(0, 0, 0, 0.7, 0.7)))
    noisy = (blurred + 0.05 * torch.randn_like(blurred)).clamp(0, 1)
    assert clip_scores(noisy, labels)["all"].mean() > 0.95
