"""The model repository: what Triton serves from, on disk or in S3-compatible object storage.

The ground floor of skewserve: the exporter publishes into it, the controller and the command line
read and change its desired state, nothing here imports them. One module per concern:

- `layout.py`: names and folders (version folders, model cards, staging, records);
- `model_config.py`: Triton configs parsed, rendered, pinned to versions;
- `disk.py`, `s3.py`: the primitives (locks, fsynced atomic writes; the S3 client, conditional PUTs);
- `publish.py`, `object_publish.py`: a staged version published, atomically, with its configs;
- `backend.py`: the serving backend kept per model;
- `desired_state.py`: the record of what is published, served and in canary;
- `state_store.py` (+ `disk_store.py`, `object_store.py`, `stores.py`): that record and the configs,
  read and written conditionally;
- `errors.py`: what goes wrong, each error naming the fix.
"""
