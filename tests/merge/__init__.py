"""Merging (bitdelta/merge/): MonoSoup, the SVD soup, OPCM, LoRA adapters and K-Merge."""
