"""The build step that ships `jaxllm_lm_eval.pth` (see _jaxllm_lm_eval.py) into site-packages.

A wheel carries the file at its root, so the installer puts it next to the packages. An
editable install (PEP 660) runs the same command with `editable_mode` set; setuptools then
points `install.install_lib` at the directory that becomes the editable wheel, so the file goes
there and `pip install -e .` installs it too.
"""

import os

from setuptools.command.build_py import build_py as _build_py

PTH = "jaxllm_lm_eval.pth"
# .pth files are read in name order: this one comes after setuptools' `__editable__.*.pth`,
# whose finder makes `_jaxllm_lm_eval` importable in an editable install.
LINE = "import _jaxllm_lm_eval; _jaxllm_lm_eval.install()\n"


class build_py(_build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            root = self.get_finalized_command("install").install_lib
        else:
            root = self.build_lib
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH), "w", encoding="utf-8") as f:
            f.write(LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH)]
