"""Running the pipeline in production: the promotion gate, Training Operator jobs, the Pushgateway, and the
Kubeflow step bodies."""
