package task

import (
	"time"

	"github.com/tandem-run/tandem/api"
)

// Observer is told what the engine does, for metrics. Calls are cheap and
// never block the engine; nil observers are fine.
type Observer interface {
	TaskSubmitted()
	TaskRunning(sinceSubmit time.Duration)
	TaskEnded(reason api.TerminationReason)
	ImagePulled(bytes int64, took time.Duration, err error)
	// Recovered reports a start's recovery: how long it took and how many
	// tasks each decision (decide.go's action names) covered.
	Recovered(took time.Duration, actions map[string]int)
}

type noObserver struct{}

func (noObserver) TaskSubmitted()                          {}
func (noObserver) TaskRunning(time.Duration)               {}
func (noObserver) TaskEnded(api.TerminationReason)         {}
func (noObserver) ImagePulled(int64, time.Duration, error) {}
func (noObserver) Recovered(time.Duration, map[string]int) {}

func (e *Engine) obs() Observer {
	if e.cfg.Observer == nil {
		return noObserver{}
	}
	return e.cfg.Observer
}
