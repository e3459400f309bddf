"""A suite of two of the default's four data sets, for the whole-pipeline runs whose subject is not the suite
(containers against subprocesses, a killed training step, kfp.local's whole pipeline): the captioned set's
retrieval and diagnostics and tuxpaint's zero-shot and linear probe are every task and every aggregate of the
default, and the same steps per data set, at half the evaluation steps (CI's time: each is a process that loads
torch and open_clip). The default's four run in tests/test_dvc_pipeline.py; the Kubeflow evaluation's fan-out over
a user's suite in tests/test_eval_suite_pipelines.py."""

import json

SUITE = {"captioned": {"source": "captioned", "tasks": ["retrieval", "diagnostics"]},
         "tuxpaint": {"source": "tuxpaint", "tasks": ["zeroshot", "linear-probe"]}}
SET = ["--set", f"eval.datasets={json.dumps(SUITE)}"]  # run-local's (and cloob's) arguments
