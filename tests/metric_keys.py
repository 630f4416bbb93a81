"""The metrics JSON keys (the design card's "Metrics JSON"), spelled out here
rather than imported from lemix.report.metrics, so a silent rename there fails
the tests that compare against this list."""

DESIGN_KEYS = [
    "policy",
    "seed",
    "request_rate",
    "train_rate",
    "duration_s",
    "num_inference",
    "num_training",
    "num_completed_inference",
    "num_completed_training",
    "num_rejected",
    "num_lost",
    "throughput_tasks_s",
    "throughput_tokens_s",
    "goodput_rps",
    "slo_attainment",
    "ttft_s",
    "tbt_s",
    "e2e_s",
    "utilization",
    "inference_loss",
    "decision_latency_us",
    "serving_staleness_updates",
    "throughput_tasks_s_paper",
]
