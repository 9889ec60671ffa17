import pytest
from hypothesis import given, settings, strategies as st

from steprl_jax.tools.calculator import calculate, calculator_tool
from steprl_jax.tools.protocol import INVALID_VALUE, ToolError


@pytest.mark.parametrize("expression, expected", [
    ("48/2", "24"), ("0.2*50", "10"), ("5/2", "2.5"), ("1/3", "0.3333333333"), ("-(3 - 10)", "7"),
    ("2**10", "1024"), ("10//3", "3"), ("10 % 4", "2"), ("sqrt(16)", "4"), ("sqrt(2)", "1.4142135624"),
    ("round(2.5)", "3"), ("round(2.345, 2)", "2.35"), ("min(3, 1, 2) + max(1, 9)", "10"), ("abs(-2.5)", "2.5"),
    ("floor(7/2) + ceil(7/2)", "7"), ("8**(1/3)", "2"), ("0.1 + 0.2", "0.3"), ("2^3", "8"), ("1e3", "1000"),
])
def test_exact_arithmetic(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("attack", [
    "__import__('os')", "().__class__", "x.y", "open('f')", "lambda: 1", "[1]", "'a' * 3", "9**9**9**9",
    "1" * 10_000, "10**100000", "1e99999999", "(" * 300 + "1" + ")" * 300, "2**3400 * 2**3400", "1/0",
    "1,000", "True + 1", "", "sqrt(-1)", "(-8)**(1/3)",
])
def test_attacks_and_bad_input_are_error_messages(attack):
    with pytest.raises(ToolError) as err:
        calculate(attack)
    assert err.value.error_type == INVALID_VALUE and err.value.message


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/%().,^ e" + "sqrtabminxflooceil_'", max_size=60))
def test_fuzz_never_raises_anything_but_tool_error(text):
    result = calculator_tool()({"expression": text})
    assert result.ok or result.error_type in ("invalid_value", "malformed_arguments")


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_matches_python_integers(a, b):
    assert calculate(f"{a} + {b} * 3") == str(a + b * 3)
