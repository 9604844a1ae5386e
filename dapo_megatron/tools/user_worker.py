"""The process one call of your tool runs in (started by :class:`dapo_megatron.tools.user_tools.FunctionTool`):

    python -m dapo_megatron.tools.user_worker "path/to/file.py:name" OUTPUT_BYTES

It reads ``{"text": ..., "metadata": {...}}`` (JSON) from stdin, imports your function, calls
``name(text, metadata)`` and writes one JSON object to its stdout: ``{"ok": true, "text": answer, "truncated":
bool}`` or ``{"ok": false, "error": what went wrong}``. What your function prints goes to the trainer's stderr (the
stdout it inherits is the answer's channel, so fd 1 is pointed at stderr before your module is imported).

Standard library only, plus the reward plug-in's loader of a function by file path or module name
(:func:`dapo_megatron.reward.function.load_reward_function`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(argv: list[str]) -> int:
    target, limit = argv[0], int(argv[1])
    answer_channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        request = json.loads(sys.stdin.read())
        from dapo_megatron.reward.function import load_reward_function

        function = load_reward_function(target)
        answer = function(request["text"], request["metadata"])
    except Exception as error:  # your function's, whatever it is: an answer to the model, not a crash
        frames = traceback.extract_tb(error.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        reply = {"ok": False, "error": f"{type(error).__name__}: {error}{where}"}
    else:
        if isinstance(answer, str):
            data = answer.encode("utf-8", errors="replace")
            reply = {"ok": True, "text": data[:limit].decode("utf-8", errors="ignore"),
                     "truncated": len(data) > limit}
        else:
            reply = {"ok": False, "error": f"it returned {type(answer).__name__}, expected str"}
    answer_channel.write(json.dumps(reply))
    answer_channel.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
