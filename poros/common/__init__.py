"""What training (`poros.finetune`) and the benchmark harness (`poros.harness`) both use, below both: reading
YAML (`yamlfile`) and owning an output folder (`folders`)."""
