package executor

import "testing"

func TestStateMoves(t *testing.T) {
	all := []State{WaitSubmit, WaitRun, ServeLogs, WaitLogsFinished}
	allowed := map[[2]State]bool{
		{WaitSubmit, WaitRun}: true, {WaitRun, WaitRun}: true, // submit, and a re-submit
		{WaitRun, ServeLogs}:           true,                                    // run, once
		{WaitSubmit, WaitLogsFinished}: true, {WaitRun, WaitLogsFinished}: true, // stop before run
		{ServeLogs, WaitLogsFinished}: true, {WaitLogsFinished, WaitLogsFinished}: true, // the end, and a stop after it
	}
	for _, from := range all {
		for _, to := range all {
			if got, want := canMove(from, to), allowed[[2]State{from, to}]; got != want {
				t.Errorf("%s -> %s: got %v, want %v", from, to, got, want)
			}
		}
	}
}
