"""Evaluation beyond the jobs' own: `code_eval`, pass@k of a checkpoint on the code tasks
(HumanEval and the generated 'functions' tasks) through the rollout engine and the sandbox;
`board_eval`, a board-game checkpoint's greedy games against each built-in opponent."""
