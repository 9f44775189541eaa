"""`splitserve serve` as a user runs it: a subprocess that starts Ray, serves gRPC, answers, exits."""
import subprocess
import sys


def test_serve_answers_a_request_like_the_single_engine_and_leaves_no_ray(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    prompt = "def add(a, b):"
    served = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--model", model, "--port", "0",
                             "--transport", "tcp", "--request", prompt, "--max-tokens", "12"],
                            capture_output=True, text=True, timeout=240)
    assert served.returncode == 0, served.stderr[-2000:]
    alone = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--model", model, "--max-tokens", "12",
                            prompt], capture_output=True, text=True, timeout=120, check=True)
    assert served.stdout == alone.stdout
    assert "serving llama" in served.stderr or "serving" in served.stderr
    leftover = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "Ray processes were left running"
