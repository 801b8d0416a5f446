"""Shape-grouped batching for the local Python-backend runners, copied beside them as `batching.py`.

Triton's dynamic batcher hands `execute` several requests at once; requests whose inputs have the
same per-item shapes are concatenated into one run and split back. Requests of different lengths
run apart: padding them together could change what a model computes.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


def run_grouped(requests, input_names, output_names, run):
    """Run requests grouped by their inputs' shapes; one InferenceResponse per request, in order."""
    arrays = [[pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in input_names] for r in requests]
    groups = {}
    for i, xs in enumerate(arrays):
        groups.setdefault(tuple(x.shape[1:] for x in xs), []).append(i)
    results = [None] * len(requests)
    for members in groups.values():
        batch = [
            np.concatenate([arrays[i][k] for i in members]) if len(members) > 1 else arrays[members[0]][k]
            for k in range(len(input_names))
        ]
        outputs = run(batch)
        bounds = np.cumsum([len(arrays[i][0]) for i in members])[:-1]
        per_output = [np.split(o, bounds) for o in outputs]
        for j, i in enumerate(members):
            results[i] = [parts[j] for parts in per_output]
    responses = []
    for request, outs in zip(requests, results, strict=True):
        wanted = set(request.requested_output_names()) or set(output_names)
        tensors = [
            pb_utils.Tensor(name, np.ascontiguousarray(value))
            for name, value in zip(output_names, outs, strict=True)
            if name in wanted
        ]
        responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
    return responses
