"""Validation of a posted prompt against the recorded /object_info, as ComfyUI v0.8.0 does it.

Mirrors `execution.validate_prompt` / `validate_inputs`: error types, messages and the
`node_errors` shape are those of validation_errors.json. Like the real server it converts
literal inputs in place (an INT given as "64" is stored as 64) and it turns an exception
raised while following a link (a link to a missing node: KeyError) into a node error.
LoadImage and LoadVideo check their file instead of their combo list (VALIDATE_INPUTS:
fake_comfy.inputs), when the server's folders are given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fake_comfy import recorded
from fake_comfy.inputs import CUSTOM_VALIDATION, Folders, custom_errors


class MalformedPrompt(Exception):
    """The prompt is not a mapping of node id to node mapping; the real server fails with
    an unhandled exception there, which the HTTP layer answers with the 500 page."""


@dataclass
class Validation:
    """Outcome of `validate_prompt`.

    ok: the prompt can be queued (`outputs` non-empty).
    error: the `error` object of a 400 answer, None when ok.
    outputs: output node ids that validated, in prompt order (`outputs_to_execute`).
    node_errors: {node_id: {"errors": [...], "dependent_outputs": [...], "class_type"}};
        may be non-empty when ok (an output was dropped: validation_errors.json).
    """

    ok: bool
    error: dict[str, Any] | None
    outputs: list[str] = field(default_factory=list)
    node_errors: dict[str, Any] = field(default_factory=dict)


def _error(kind: str, message: str, details: str) -> dict[str, Any]:
    return {"type": kind, "message": message, "details": details, "extra_info": {}}


def _full_type_name(exc: BaseException) -> str:
    # ComfyUI's full_type_name: builtins are bare ("KeyError"), others module-qualified.
    klass = type(exc)
    if klass.__module__ == "builtins":
        return klass.__qualname__
    return f"{klass.__module__}.{klass.__qualname__}"


def _types_compatible(received: Any, wanted: Any) -> bool:
    """comfy_execution.validation.validate_node_input (non-strict)."""
    if received == wanted:
        return True
    if not isinstance(received, str) or not isinstance(wanted, str):
        return False
    got = {t.strip() for t in received.split(",")}
    want = {t.strip() for t in wanted.split(",")}
    if "*" in got or "*" in want:
        return True
    return bool(got & want)


def _input_specs(definition: dict[str, Any]) -> list[tuple[str, str, list[Any]]]:
    """(name, "required"|"optional", spec) for every declared input, in input_order."""
    declared = definition["input"]
    order = definition.get("input_order", {})
    result = []
    for category in ("required", "optional"):
        specs = declared.get(category, {})
        for name in order.get(category, list(specs)):
            result.append((name, category, specs[name]))
    return result


def _combo_options(spec: list[Any]) -> list[Any] | None:
    """The allowed values of a combo input: old style `[[...], {...}]` or V3 `["COMBO",
    {"options": [...]}]`; None for any other input."""
    kind = spec[0]
    if isinstance(kind, list):
        return kind
    if kind == "COMBO" and len(spec) > 1:
        return list(spec[1].get("options", []))
    return None


class _Validator:
    def __init__(
        self, prompt: dict[str, Any], object_info: dict[str, Any], folders: Folders | None
    ) -> None:
        self.prompt = prompt
        self.object_info = object_info
        self.folders = folders
        # node id -> (valid, reasons); insertion order is the order ComfyUI reports.
        self.validated: dict[str, tuple[bool, list[dict[str, Any]]]] = {}

    def node(self, unique_id: str) -> tuple[bool, list[dict[str, Any]]]:
        """validate_inputs: may raise like the real one (KeyError for a missing link)."""
        if unique_id in self.validated:
            return self.validated[unique_id]
        inputs = self.prompt[unique_id]["inputs"]
        class_type = self.prompt[unique_id]["class_type"]
        definition = self.object_info[class_type]
        errors: list[dict[str, Any]] = []
        valid = True
        for name, category, spec in _input_specs(definition):
            input_type = spec[0]
            extra = spec[1] if len(spec) > 1 else {}
            info = [input_type, extra]
            if name not in inputs:
                if category == "required":
                    errors.append(
                        {
                            "type": "required_input_missing",
                            "message": "Required input is missing",
                            "details": name,
                            "extra_info": {"input_name": name},
                        }
                    )
                continue
            val = inputs[name]
            if isinstance(val, list):
                if not self._link(name, val, input_type, info, errors):
                    valid = False
                continue
            checks_itself = (
                self.folders is not None and name == CUSTOM_VALIDATION.get(class_type, ("", ""))[0]
            )
            self._literal(inputs, name, val, spec, info, errors, checks_itself)
        if self.folders is not None:
            # After every input, as validate_inputs calls VALIDATE_INPUTS last.
            errors.extend(custom_errors(class_type, inputs, self.folders))
        result = (not errors and valid, errors)
        self.validated[unique_id] = result
        return result

    def _link(
        self, name: str, val: list[Any], input_type: Any, info: list[Any], errors: list[Any]
    ) -> bool:
        """Checks a `[node_id, slot]` input; False when the linked node is invalid."""
        if len(val) != 2:
            errors.append(
                {
                    "type": "bad_linked_input",
                    "message": "Bad linked input, must be a length-2 list of [node_id, slot_index]",
                    "details": name,
                    "extra_info": {"input_name": name, "input_config": info, "received_value": val},
                }
            )
            return True
        o_id = val[0]
        # Same indexing as the real server, so a missing node raises KeyError('9').
        o_class = self.prompt[o_id]["class_type"]
        received_type = tuple(self.object_info[o_class]["output"])[val[1]]
        if not _types_compatible(received_type, input_type):
            errors.append(
                {
                    "type": "return_type_mismatch",
                    "message": "Return type mismatch between linked nodes",
                    "details": f"{name}, {received_type} != {input_type}",
                    "extra_info": {
                        "input_name": name,
                        "input_config": info,
                        "received_type": received_type,
                        "linked_node": val,
                    },
                }
            )
            return True
        try:
            linked_valid, _ = self.node(o_id)
        except Exception as ex:  # the real server reports any of these as a node error
            self.validated[o_id] = (
                False,
                [
                    {
                        "type": "exception_during_inner_validation",
                        "message": "Exception when validating inner node",
                        "details": str(ex),
                        "extra_info": {
                            "input_name": name,
                            "input_config": info,
                            "exception_message": str(ex),
                            "exception_type": _full_type_name(ex),
                            "traceback": recorded.partial_node_error()["extra_info"]["traceback"],
                            "linked_node": val,
                        },
                    }
                ],
            )
            return False
        return linked_valid

    @staticmethod
    def _literal(
        inputs: dict[str, Any],
        name: str,
        val: Any,
        spec: list[Any],
        info: list[Any],
        errors: list[Any],
        checks_itself: bool = False,
    ) -> None:
        """Converts a literal input and checks its limits and combo list, except for an
        input the node's VALIDATE_INPUTS checks itself (``checks_itself``)."""
        input_type = spec[0]
        try:
            if isinstance(val, dict) and "__value__" in val:
                val = val["__value__"]
                inputs[name] = val
            convert = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}.get(
                input_type if isinstance(input_type, str) else ""
            )
            if convert is not None:
                val = convert(val)
                inputs[name] = val
        except (TypeError, ValueError, OverflowError) as ex:
            errors.append(
                {
                    "type": "invalid_input_type",
                    "message": f"Failed to convert an input value to a {input_type} value",
                    "details": f"{name}, {val}, {ex}",
                    "extra_info": {
                        "input_name": name,
                        "input_config": info,
                        "received_value": val,
                        "exception_message": str(ex),
                    },
                }
            )
            return
        if checks_itself:
            return
        limits = info[1]
        for key, word, below in (
            ("min", "smaller than min", True),
            ("max", "bigger than max", False),
        ):
            if key in limits and (val < limits[key] if below else val > limits[key]):
                errors.append(
                    {
                        "type": "value_smaller_than_min" if below else "value_bigger_than_max",
                        "message": f"Value {val} {word} of {limits[key]}",
                        "details": name,
                        "extra_info": {
                            "input_name": name,
                            "input_config": info,
                            "received_value": val,
                        },
                    }
                )
                return
        options = _combo_options(spec)
        if options is not None and val not in options:
            big = len(options) > 20
            list_info = f"(list of length {len(options)})" if big else str(options)
            errors.append(
                {
                    "type": "value_not_in_list",
                    "message": "Value not in list",
                    "details": f"{name}: '{val}' not in {list_info}",
                    "extra_info": {
                        "input_name": name,
                        "input_config": None if big else info,
                        "received_value": val,
                    },
                }
            )


def output_nodes(prompt: dict[str, Any], object_info: dict[str, Any] | None = None) -> list[str]:
    """Ids of the prompt's output nodes (`output_node` in /object_info), in prompt order."""
    info = object_info if object_info is not None else recorded.object_info()
    return [x for x, node in prompt.items() if info[node["class_type"]].get("output_node") is True]


def validate_prompt(
    prompt: Any,
    partial_targets: list[str] | None = None,
    object_info: dict[str, Any] | None = None,
    folders: Folders | None = None,
) -> Validation:
    """Validates `prompt` ({node_id: {"class_type", "inputs"}}) like ComfyUI v0.8.0.

    Returns a Validation; `invalid_prompt` (unknown class), `prompt_no_outputs` and
    `prompt_outputs_failed_validation` are 400 answers (validation_errors.json). With
    `folders`, LoadImage and LoadVideo check that their file exists ("Invalid image file:
    NAME", upload.json); without, their file name must be in the combo list.
    Raises MalformedPrompt when `prompt` or a node is not a JSON object.
    """
    info = object_info if object_info is not None else recorded.object_info()
    if not isinstance(prompt, dict) or not all(isinstance(n, dict) for n in prompt.values()):
        raise MalformedPrompt("prompt must map node ids to node objects")
    outputs: list[str] = []
    for x, node in prompt.items():
        if "class_type" not in node:
            return Validation(
                False,
                _error(
                    "invalid_prompt",
                    "Cannot execute because a node is missing the class_type property.",
                    f"Node ID '#{x}'",
                ),
            )
        class_type = node["class_type"]
        if not isinstance(class_type, str) or class_type not in info:
            return Validation(
                False,
                _error(
                    "invalid_prompt",
                    f"Cannot execute because node {class_type} does not exist.",
                    f"Node ID '#{x}'",
                ),
            )
        if info[class_type].get("output_node") is True and (
            partial_targets is None or x in partial_targets
        ):
            outputs.append(x)
    if not outputs:
        return Validation(False, _error("prompt_no_outputs", recorded.MSG_NO_OUTPUTS, ""))

    validator = _Validator(prompt, info, folders)
    good: list[str] = []
    node_errors: dict[str, Any] = {}
    for o in outputs:
        try:
            valid, _ = validator.node(o)
        except Exception as ex:  # the real server reports any of these as a node error
            reason = recorded.partial_node_error()
            reason["details"] = str(ex)
            reason["extra_info"]["exception_type"] = _full_type_name(ex)
            validator.validated[o] = (False, [reason])
            valid = False
        if valid:
            good.append(o)
            continue
        for node_id, (node_valid, reasons) in validator.validated.items():
            # Nodes downstream of an invalid one are invalid without reasons: not reported.
            if node_valid or not reasons:
                continue
            if node_id not in node_errors:
                node_errors[node_id] = {
                    "errors": reasons,
                    "dependent_outputs": [],
                    "class_type": prompt[node_id]["class_type"],
                }
            node_errors[node_id]["dependent_outputs"].append(o)
    if not good:
        return Validation(
            False,
            _error("prompt_outputs_failed_validation", recorded.MSG_FAILED_VALIDATION, ""),
            [],
            node_errors,
        )
    return Validation(True, None, good, node_errors)
