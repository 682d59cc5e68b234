"""Merging toolkit: combine task vectors of one base model.

Two different problems live here; they share only linear algebra helpers.

Full fine-tunes (checkpoint directories in the Hugging Face layout):
  `monosoup`  MonoSoup (arXiv:2602.09689): ONE fine-tuned checkpoint, per-layer
              SVD of Δ, re-weighted high/low spectrum. Data-free, no knobs.
  `svdsoup`   the brief's "SVD soup": mean of rank-r truncated task vectors of
              SEVERAL checkpoints, plus a training hook that soups the current
              weights with the best so far every N steps. Not MonoSoup.
  `opcm`      OPCM (arXiv:2501.09522): sequential merging by orthogonal
              projection with λ rescaling (constant memory in the number of models).

LoRA adapters on the edge:
  `adapter`   the adapter data object and PEFT-layout I/O (no PEFT needed).
  `lora`      a small LoRA trainer for the compact Llama and the adapter ↔ model glue.
  `kmerge`    K-Merge (arXiv:2510.13537): a pool of at most K merged adapters
              (or B bytes), with the brief's OPCM merge and quality gate as options.

`evaluate` scores a model on held-out text; `report` runs the real-data
evaluation behind reports/merging; `cli` adds `bitdelta merge ...` and
`bitdelta kmerge`.
"""
