"""The real model family (bitdelta/family/): corpora, the build, conversion, fine-tuning, quality."""
