"""The shapes' property scores (mhla_gen.metrics.shapes) mean what their names say: the real data set's
images score 1 on every property, and images built to lack a property (noise with the symmetry, a filled
frame, blobs and wrong shapes in the right layout, mixed colours averaging to the class colour, dim
shapes) are rejected by that property's rate and by ``all``, and accepted by the rates of the properties
they do have."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from mhla_gen.data.shapes import class_colour, class_count, class_radii, shapes_tensors
from mhla_gen.metrics.shapes import PROPERTIES, property_scores, property_summary, shape_template

RATES = ("symmetric", "count", "colour", "shape", "all")


def real(count: int = 30, resolution: int = 32, seed: int = 7):
    return shapes_tensors(resolution, count, seed=seed)


def left_boxes(image: torch.Tensor) -> list[tuple[int, int, int]]:
    """The centres ``(row, col)`` and radii of the shapes in the left half of a real image."""
    half = image.shape[-1] // 2
    labelled, _ = ndimage.label(image[:, :, :half].amax(0).numpy() > 0.5, structure=np.ones((3, 3)))
    boxes = ndimage.find_objects(labelled)
    return [((r.start + r.stop - 1) // 2, (c.start + c.stop - 1) // 2, (r.stop - r.start) // 2)
            for r, c in boxes]


def redraw(images: torch.Tensor, labels, draw) -> torch.Tensor:
    """Each image's left-half shapes replaced by ``draw(label, index, radius) -> (mask (h, w), colours
    (3, h, w))``, centred where the shape of ``radius`` was and no larger than it (so the shapes stay
    apart), the right half its mirror image (the layout and count kept)."""
    out = torch.zeros_like(images)
    half = images.shape[-1] // 2
    for n, (image, label) in enumerate(zip(images, labels)):
        left = np.zeros((3, images.shape[-2], half), dtype=np.float32)
        for k, (row, col, radius) in enumerate(left_boxes(image)):
            mask, colours = draw(int(label), k, radius)
            assert max(mask.shape) <= 2 * radius + 1
            h, w = mask.shape
            top, lft = row - h // 2, col - w // 2
            left[:, top:top + h, lft:lft + w] = np.where(mask, colours, left[:, top:top + h, lft:lft + w])
        out[n] = torch.from_numpy(np.concatenate([left, left[:, :, ::-1]], axis=2))
    return out


def solid(label, mask):
    return mask, np.broadcast_to(class_colour(label)[:, None, None], (3, *mask.shape))


def rates(images, labels) -> dict[str, float]:
    scores = property_scores(images, labels)
    return {k: float(scores[k].mean()) for k in RATES}


def expect(images, labels, what="", **want):
    got = rates(images, labels)
    assert got == {k: float(want[k]) for k in RATES}, (what, got)


def test_the_real_images_score_one_on_every_property_at_both_resolutions():
    for resolution in (32, 64):
        images, labels = real(40, resolution)
        expect(images, labels, symmetric=1, count=1, colour=1, shape=1, all=1)
        assert (property_scores(images, labels)["symmetry_error"] == 0).all()
    summary = property_summary(*real(10))
    assert summary["shape_accuracy"] == 1.0 and summary["shapes_scorer"] == 2


def test_templates_are_the_data_sets_shapes():
    """Every component of a real image is exactly a template of its class's radii (so IoU 1)."""
    images, labels = real(20)
    for image, label in zip(images, labels):
        mask = image.amax(0).numpy() > 0.5
        labelled, n = ndimage.label(mask, structure=np.ones((3, 3)))
        low, high = class_radii(int(label), 32)
        for box in ndimage.find_objects(labelled):
            component = mask[box]
            radius = component.shape[0] // 2
            assert low <= radius <= high and any(np.array_equal(component, shape_template(kind, radius))
                                                 for kind in ("disc", "square"))


def test_symmetric_noise_has_no_property():
    images, labels = real(20)
    g = torch.Generator().manual_seed(0)
    left = torch.rand(len(images), 3, 32, 16, generator=g)
    noise = torch.cat([left, left.flip(-1)], dim=-1)  # mirror-symmetric, exactly
    expect(noise, labels, symmetric=0, count=0, colour=0, shape=0, all=0)


def test_a_filled_frame_has_no_property():
    images, labels = real(20)
    frame = torch.stack([torch.from_numpy(class_colour(int(c)))[:, None, None].expand(3, 32, 32)
                         for c in labels])  # the class colour everywhere: symmetric, one component
    expect(frame, labels, symmetric=0, count=0, colour=0, shape=0, all=0)


def test_blobs_and_wrong_shapes_in_the_right_layout_fail_shape_and_all():
    """The class's count, colour and mirrored layout, but no disc or square of the class's size: the
    count, colour and symmetric rates hold (those properties are there), shape and all do not."""
    images, labels = real(30)

    def blob(r):  # an ellipse about twice as wide as tall
        rows, cols = np.ogrid[-(r // 2):r // 2 + 1, -r:r + 1]
        return (rows / (r / 2 + 0.5)) ** 2 + (cols / (r + 0.5)) ** 2 <= 1

    def ring(r):  # a hollow square
        return shape_template("square", r) & ~np.pad(shape_template("square", r - 1), 1)

    def smaller(r, c):  # a square below the class's radii (2 for classes 0-4, 1 for 5-9)
        return shape_template("square", class_radii(c, 32)[0] - 1)

    wrong = {"blob": lambda c, k, r: blob(r), "ring": lambda c, k, r: ring(r),
             "triangle": lambda c, k, r: np.tril(np.ones((2 * r + 1,) * 2, bool)),
             "smaller": lambda c, k, r: smaller(r, c)}
    for name, mask in wrong.items():
        drawn = redraw(images, labels, lambda c, k, r, m=mask: solid(c, m(c, k, r)))
        expect(drawn, labels, name, symmetric=1, count=1, colour=1, shape=0, all=0)


def test_mixed_colours_averaging_to_the_class_colour_fail_colour():
    """Classes 1, 4, 7 (two shapes a half): one shape in the previous class's colour, the other in the
    next one's, equal squares, so the image's mean foreground colour is nearest the class colour; and
    each shape a checkerboard of the two (each shape's own mean is then the average). Both fail colour."""
    labels = torch.tensor([1, 4, 7] * 6)
    images, _ = shapes_tensors(32, 60, seed=9)
    images = images[torch.cat([torch.nonzero(torch.arange(60) % 10 == c)[:6, 0] for c in (1, 4, 7)])]
    labels = labels.reshape(6, 3).T.reshape(-1)

    def across(c, k, radius):
        mask = shape_template("square", class_radii(c, 32)[0])
        colour = class_colour(c - 1 if k == 0 else c + 1)
        return mask, np.broadcast_to(colour[:, None, None], (3, *mask.shape))

    def checkerboard(c, k, radius):
        mask = shape_template("square", class_radii(c, 32)[0])
        even = (np.add.outer(np.arange(mask.shape[0]), np.arange(mask.shape[1])) % 2 == 0)[None]
        return mask, np.where(even, class_colour(c - 1)[:, None, None], class_colour(c + 1)[:, None, None])

    for draw in (across, checkerboard):
        mixed = redraw(images, labels, draw)
        fg = mixed.amax(1) > 0.5
        mean = (mixed * fg[:, None]).sum((2, 3)) / fg.sum((1, 2))[:, None]  # the old scorer's colour
        palette = torch.from_numpy(np.stack([class_colour(c) for c in range(10)]))
        assert torch.equal((mean[:, None] - palette[None]).square().sum(-1).argmin(-1), labels)
        expect(mixed, labels, draw.__name__, symmetric=1, count=1, colour=0, shape=1, all=0)


def test_dim_shapes_fail_colour_and_nothing_drawn_fails_everything():
    images, labels = real(20)
    expect(images * 0.6, labels, symmetric=1, count=1, colour=0, shape=1, all=0)  # foreground, too dark
    expect(images * 0.4, labels, symmetric=0, count=0, colour=0, shape=0, all=0)  # below the foreground


def test_the_symmetry_error_does_not_reward_drawing_less():
    """Normalised by what is drawn: a blank image or one side blank scores 1 (the worst), a mirror
    image 0, a real image with one shape moved a pixel in between; and a scaled-down drawing scores what
    the full one does."""
    images, labels = real(10)
    half = images.clone()
    half[..., 16:] = 0
    moved = images.clone()
    moved[..., :16] = torch.roll(images[..., :16], 1, dims=-2)  # the left half one row down
    errors = {name: property_scores(x, labels)["symmetry_error"]
              for name, x in (("blank", torch.zeros_like(images)), ("half", half), ("moved", moved),
                              ("dimmer", moved * 0.5))}
    assert (errors["blank"] == 1).all() and (errors["half"] == 1).all()
    assert ((errors["moved"] > 0) & (errors["moved"] < 1)).all()
    np.testing.assert_allclose(errors["dimmer"], errors["moved"], rtol=1e-12)
    s = property_scores(half, labels)
    assert not s["symmetric"].any() and not s["count"].any() and s["colour"].all()


def test_a_shape_crossing_the_centre_line_is_not_a_symmetric_image():
    """A mirrored layout whose shapes join across the centre line is one component there: not a valid
    image, so not symmetric, however well it mirrors."""
    labels = torch.tensor([0, 3, 6, 9])  # one shape a half
    image = torch.zeros(4, 3, 32, 32)
    for n, c in enumerate(labels.tolist()):
        image[n, :, 10:17, 13:19] = torch.from_numpy(class_colour(c))[:, None, None]
    s = property_scores(image, labels)
    assert not s["symmetric"].any() and not s["count"].any()


def test_property_scores_refuse_wrong_inputs():
    with pytest.raises(ValueError, match="RGB"):
        property_scores(torch.zeros(2, 1, 32, 32), [0, 1])
    with pytest.raises(ValueError, match="labels"):
        property_scores(torch.zeros(2, 3, 32, 32), [0])
    assert set(PROPERTIES) == set(RATES) and class_count(4) == 2
