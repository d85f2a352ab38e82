"""Comparison grids: exact cell pixels after the known upscale, labels drawn, paging, video grids
and their MP4/GIF files read back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowgrpo.grids import (BACKGROUND, grid_layout, image_grid, load_font, page_paths, paginate,
                            render_image_grid, render_video_grid, save_video, upscale,
                            upscale_factor, video_grid, wrap_text)
from flowgrpo.pixels import to_uint8


def _images(rows: int, cols: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(rows, cols, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_to_uint8_rounds_to_nearest_level_and_moves_channels_last():
    media = torch.tensor([0.0, 1.0, 0.5, 0.2, -3.0, 7.0]).view(1, 1, 6).expand(3, 1, 6)
    pixels = to_uint8(media)
    assert pixels.shape == (1, 6, 3) and pixels.dtype == np.uint8
    assert pixels[0, :, 0].tolist() == [0, 255, 128, 51, 0, 255]   # 127.5 -> 128, 51.0 -> 51


@pytest.mark.parametrize("height,width,min_size,factor", [
    (24, 24, 96, 4), (32, 32, 96, 3), (100, 50, 96, 2), (512, 512, 96, 1), (25, 40, 96, 4)])
def test_upscale_factor_is_smallest_integer_reaching_min_size(height, width, min_size, factor):
    assert upscale_factor(height, width, min_size) == factor
    assert factor * min(height, width) >= min_size
    assert factor == 1 or (factor - 1) * min(height, width) < min_size


def test_upscale_repeats_each_pixel_into_a_block():
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    big = upscale(pixels, 3)
    assert big.shape == (6, 9, 3)
    for y in range(6):
        for x in range(9):
            assert (big[y, x] == pixels[y // 3, x // 3]).all()


@pytest.mark.parametrize("labelled", [True, False])
def test_cells_hold_exactly_the_upscaled_input_pixels(labelled):
    images = _images(2, 3, 24)
    labels = dict(row_labels=["a red square above a blue circle", "two cats"],
                  col_labels=["base", "run@10", "run@20"],
                  cell_labels=[["0.1 r", "0.2 r", "0.3 r"], ["0.4 r", None, "0.6 r\n0.7 s"]]
                  ) if labelled else {}
    image, layout = render_image_grid(images, **labels)
    pixels = np.array(image)
    assert layout.scale == 4 and (layout.cell_width, layout.cell_height) == (96, 96)
    assert pixels.shape == (layout.height, layout.width, 3)
    expected = upscale(to_uint8(images), 4)
    covered = np.zeros(pixels.shape[:2], dtype=bool)
    for r in range(2):
        for c in range(3):
            left, top, right, bottom = layout.cell_box(r, c)
            assert (pixels[top:bottom, left:right] == expected[r, c]).all()
            covered[top:bottom, left:right] = True
    assert covered.sum() == 6 * 96 * 96                 # cells do not overlap
    if not labelled:                                    # everything else is background
        assert (pixels[~covered] == np.array(BACKGROUND, dtype=np.uint8)).all()
        # Closed form without labels: a 4 px gap around 96 px cells.
        assert pixels.shape == (4 + 2 * 100, 4 + 3 * 100, 3)
        assert layout.cell_box(1, 2) == (4 + 2 * 100, 4 + 100, 4 + 2 * 100 + 96, 4 + 100 + 96)
        assert (pixels[104:200, 204:300] == expected[1, 2]).all()
    assert np.array_equal(pixels, np.array(image_grid(images, **labels)))


def test_labels_are_drawn_in_their_bands():
    images = torch.ones(2, 2, 3, 24, 24)                 # white cells: any dark pixel is text
    image, layout = render_image_grid(images, row_labels=["first prompt", "second"],
                                      col_labels=["base", "tuned"],
                                      cell_labels=[["0.5 ocr", "0.9 ocr"], ["", "0.1 ocr"]])
    dark = (np.array(image) < 128).all(axis=-1)
    assert layout.header_height > 0 and layout.row_label_width > 0 and layout.caption_height > 0
    for c in range(2):
        left, top, right, bottom = layout.cell_box(0, c)
        assert dark[:top, left:right].any(), f"column label {c} missing"
    for r in range(2):
        left, top, right, bottom = layout.cell_box(r, 0)
        assert dark[top:bottom, :layout.row_label_width].any(), f"row label {r} missing"
    captions = {(r, c): dark[layout.cell_box(r, c)[3]:layout.cell_box(r, c)[3] + layout.caption_height,
                             layout.cell_box(r, c)[0]:layout.cell_box(r, c)[2]].any()
                for r in range(2) for c in range(2)}
    assert captions == {(0, 0): True, (0, 1): True, (1, 0): False, (1, 1): True}


def test_label_counts_must_match_the_grid():
    with pytest.raises(ValueError, match="col_labels must have 3 entries"):
        image_grid(_images(1, 3, 8), col_labels=["a", "b"])
    with pytest.raises(ValueError, match=r"cell_labels\[0\] must have 3 entries"):
        image_grid(_images(1, 3, 8), cell_labels=[["a"]])
    with pytest.raises(ValueError, match=r"images must have shape \(R, C, 3, H, W\)"):
        image_grid(torch.rand(3, 8, 8))


def test_wrapped_lines_fit_the_width_and_the_line_budget():
    font = load_font(14)
    text = "a very long prompt about a red square to the left of a green circle " * 3
    lines = wrap_text(text, font, 100, max_lines=3)
    assert len(lines) == 3 and lines[-1].endswith("...")
    assert all(font.getlength(line) <= 100 for line in lines)
    assert wrap_text("short", font, 100, max_lines=3) == ["short"]
    assert wrap_text("x" * 200, font, 50, max_lines=2)[0].startswith("xxx")


@pytest.mark.parametrize("num_rows,max_rows,sizes", [
    (17, 8, [6, 6, 5]), (8, 8, [8]), (9, 8, [5, 4]), (1, 8, [1]), (6, 1, [1] * 6)])
def test_paginate_balances_pages_and_keeps_every_row_once(num_rows, max_rows, sizes):
    pages = paginate(num_rows, max_rows)
    assert [len(p) for p in pages] == sizes
    assert [i for page in pages for i in page] == list(range(num_rows))


def test_page_paths_number_pages_only_when_there_are_several(tmp_path):
    assert page_paths(tmp_path / "grid.png", 1) == [tmp_path / "grid.png"]
    assert page_paths(tmp_path / "grid.png", 3) == [tmp_path / f"grid_00{i}.png" for i in (1, 2, 3)]


def test_paginate_rejects_empty_inputs():
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        paginate(3, 0)
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        paginate(0, 4)


def test_video_grid_plays_every_cell_with_the_image_layout():
    videos = torch.rand(2, 2, 5, 3, 24, 24, generator=torch.Generator().manual_seed(1))
    labels = dict(row_labels=["a", "b"], col_labels=["base", "tuned"])
    frames, layout = render_video_grid(videos, **labels)
    assert frames.shape == (5, layout.height, layout.width, 3) and frames.dtype == np.uint8
    assert layout.height % 16 == 0 and layout.width % 16 == 0
    expected = upscale(to_uint8(videos), layout.scale)           # (R, C, F, kH, kW, 3)
    for r in range(2):
        for c in range(2):
            left, top, right, bottom = layout.cell_box(r, c)
            assert (frames[:, top:bottom, left:right] == expected[r, c]).all()
    # The labels and geometry are those of the image grid of the first frames.
    _, image_layout = render_image_grid(videos[:, :, 0], **labels)
    assert image_layout.cell_box(1, 1) == layout.cell_box(1, 1)
    assert np.array_equal(video_grid(videos, **labels), frames)


def test_saved_mp4_and_gif_read_back_with_frame_count_and_shape(tmp_path):
    import imageio.v2 as imageio_v2
    import imageio.v3 as imageio_v3

    frames = video_grid(torch.rand(1, 2, 6, 3, 16, 16, generator=torch.Generator().manual_seed(2)),
                        col_labels=["base", "tuned"])
    written = save_video(frames, tmp_path / "grid.mp4", fps=4)
    assert written == [tmp_path / "grid.mp4", tmp_path / "grid.gif"]
    with imageio_v2.get_reader(str(tmp_path / "grid.mp4")) as reader:
        mp4 = np.stack([frame for frame in reader.iter_data()])
        assert reader.get_meta_data()["fps"] == 4
    assert mp4.shape == frames.shape
    gif = imageio_v3.imread(tmp_path / "grid.gif")
    assert gif.shape == frames.shape
    # Lossy codecs: close to the frames, not equal.
    assert np.abs(mp4.astype(int) - frames.astype(int)).mean() < 20


def test_save_video_pads_odd_sizes_to_even(tmp_path):
    import imageio.v2 as imageio_v2

    frames = np.zeros((3, 15, 21, 3), dtype=np.uint8)
    frames[1] = 100
    frames[2] = 200
    save_video(frames, tmp_path / "odd.mp4", fps=2, gif=False)
    assert not (tmp_path / "odd.gif").exists()
    with imageio_v2.get_reader(str(tmp_path / "odd.mp4")) as reader:
        mp4 = np.stack([frame for frame in reader.iter_data()])
    assert mp4.shape == (3, 16, 22, 3)


def test_grid_layout_rounds_canvas_to_multiple():
    layout = grid_layout(1, 1, 10, 10, min_cell_size=10, gap=1, multiple_of=16)
    assert (layout.width, layout.height) == (16, 16)
    assert layout.cell_box(0, 0) == (1, 1, 11, 11)
