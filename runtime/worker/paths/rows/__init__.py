"""The row-cache path: each batch row's K/V kept dense (the CPU's default; a GPU's windowed,
latent and by-hand attention layers where it fits), the CPU's compiled decode step, and
attention split over CPU streams."""
