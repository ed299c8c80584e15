"""Multimodal RoPE (M-RoPE; Qwen2-VL, Wang et al. 2024, arXiv:2409.12191; Qwen2.5-VL, Qwen3-VL).

Every token has three position ids, temporal, height and width (positions [3, B, L]); each
rotary frequency turns by one of them. `mrope_rows` says which: Qwen2-VL / Qwen2.5-VL give the
first `section[0]` frequencies to the temporal row, the next `section[1]` to height and the last
`section[2]` to width (transformers' `apply_multimodal_rotary_pos_emb`); Qwen3-VL interleaves
them, t h w t h w ..., the rows 1 and 2 stopping after `section[1]` and `section[2]` turns
(transformers' `apply_interleaved_mrope`). Text tokens carry three equal ids, which is plain
RoPE, so a text-only model needs only [B, L] positions (`jaxllm.model.attention` copies them).

`mrope_positions` builds the [3, B, L] ids of a prompt with images on the host, as
transformers' `get_rope_index` does for images: text counts on from the last id; an image of
merged grid (t, h, w) gets ids start + (ti, hi, wi), and the text after it starts at
start + max(h, w). The rope deltas (largest id + 1 - tokens) let decoding continue: a decode
step at cache length n has position n + delta on all three rows.
"""

from __future__ import annotations

import numpy as np


def mrope_rows(section: tuple[int, ...], interleaved: bool = False) -> np.ndarray:
    """Which position row (0 temporal, 1 height, 2 width) turns each of the sum(section)
    rotary frequencies: int32 [K/2]."""
    k2 = sum(section)
    if not interleaved:
        return np.repeat(np.arange(3, dtype=np.int32), section)
    rows = np.zeros(k2, np.int32)
    for row in (1, 2):
        rows[row : 3 * section[row] : 3] = row
    return rows


def mrope_positions(
    input_ids,
    image_grid_thw,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
    attention_mask=None,
) -> tuple[np.ndarray, np.ndarray]:
    """(positions int32 [3, B, L], rope deltas int32 [B, 1]) of token rows `input_ids` [B, L]
    whose images are runs of `image_token_id`, each right after a `vision_start_token_id`,
    with one (t, h, w) patch grid per image in `image_grid_thw` [N, 3], in reading order over
    the rows (the vision tower's grid, before merging `spatial_merge_size` ** 2 patches into a
    token). Tokens where `attention_mask` [B, L] is 0 (padding) are skipped and get id 0.
    Raises ValueError when the placeholders and the grids disagree."""
    ids_BxL = np.asarray(input_ids)
    grids_Nx3 = np.asarray(image_grid_thw if image_grid_thw is not None else [], np.int64)
    grids_Nx3 = grids_Nx3.reshape(-1, 3)
    b, l = ids_BxL.shape
    mask_BxL = np.ones((b, l), bool) if attention_mask is None else np.asarray(attention_mask, bool)
    positions_3xBxL = np.zeros((3, b, l), np.int32)
    deltas_B = np.zeros((b,), np.int32)
    used = 0  # images placed so far
    for row in range(b):
        ids = ids_BxL[row][mask_BxL[row]]
        pieces, start, i = [], 0, 0
        while i < len(ids):
            if ids[i] != image_token_id:  # a text run: ids count on, equal on the three rows
                j = i
                while j < len(ids) and ids[j] != image_token_id:
                    j += 1
                pieces.append(np.broadcast_to(np.arange(start, start + j - i), (3, j - i)))
                start, i = start + j - i, j
                continue
            if used == len(grids_Nx3):
                raise ValueError(f"row {row} has more images than image_grid_thw ({used})")
            if i == 0 or ids[i - 1] != vision_start_token_id:
                raise ValueError(f"row {row}: an image at token {i} without its vision start")
            t, h, w = (int(x) for x in grids_Nx3[used])
            h, w = h // spatial_merge_size, w // spatial_merge_size
            size = t * h * w
            is_image = ids[i:] == image_token_id
            run = len(is_image) if is_image.all() else int(np.argmin(is_image))
            if run != size:
                raise ValueError(
                    f"image {used} has {run} placeholder tokens; its grid {tuple(grids_Nx3[used])} "
                    f"merged by {spatial_merge_size} needs {size}"
                )
            t_Tx1x1, h_1xHx1, w_1x1xW = np.ogrid[:t, :h, :w]
            thw = [np.broadcast_to(a, (t, h, w)).reshape(-1) for a in (t_Tx1x1, h_1xHx1, w_1x1xW)]
            pieces.append(np.stack(thw) + start)
            start, i, used = start + max(h, w), i + size, used + 1
        if pieces:
            row_3xT = np.concatenate(pieces, axis=1)
            positions_3xBxL[:, row, mask_BxL[row]] = row_3xT
            deltas_B[row] = row_3xT.max() + 1 - len(ids)
    if used != len(grids_Nx3):
        raise ValueError(f"image_grid_thw has {len(grids_Nx3)} grids for {used} images")
    return positions_3xBxL, deltas_B[:, None]
