from jaxllm.cli import entry

entry()
