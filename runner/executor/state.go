package executor

import (
	"fmt"
	"slices"
)

// stateMoves lists, for each runner state, the states it may be entered
// from. A job is submitted (again while it waits for run), runs once, and
// ends in wait_logs_finished, which a stop also reaches from any state.
var stateMoves = map[State][]State{
	WaitRun:          {WaitSubmit, WaitRun},
	ServeLogs:        {WaitRun},
	WaitLogsFinished: {WaitSubmit, WaitRun, ServeLogs, WaitLogsFinished},
}

// canMove reports whether the runner may go from one state to another.
func canMove(from, to State) bool { return slices.Contains(stateMoves[to], from) }

// moveLocked enters state to when the table allows it; what names the
// request for the error (ErrState, a 409 on the wire). x.mu is held.
func (x *Executor) moveLocked(to State, what string) error {
	if !canMove(x.state, to) {
		return fmt.Errorf("%w: %s in state %s", ErrState, what, x.state)
	}
	x.state = to
	return nil
}
