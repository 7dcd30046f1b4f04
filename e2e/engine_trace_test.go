package e2e

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/docker/docker/api/types/events"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"
)

// engineTrace records when the Docker engine says each container was
// created and started (its own event clock, nanoseconds), so that a start
// measured from outside splits into the same three steps for any agent:
// submit -> created (the agent's work before and during create), created ->
// started (the engine's start), started -> answer (the runner's own start).
type engineTrace struct {
	mu   sync.Mutex
	seen map[string]*engineSteps // by container name
}

type engineSteps struct{ created, started time.Time }

// traceEngine follows the engine's container create and start events until
// the benchmark ends.
func traceEngine(b *testing.B, dc *client.Client) *engineTrace {
	b.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	msgs, errs := dc.Events(ctx, events.ListOptions{Filters: filters.NewArgs(
		filters.Arg("type", string(events.ContainerEventType)),
		filters.Arg("event", string(events.ActionCreate)),
		filters.Arg("event", string(events.ActionStart)))})
	tr := &engineTrace{seen: map[string]*engineSteps{}}
	done := make(chan struct{})
	b.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for {
			select {
			case m := <-msgs:
				name := m.Actor.Attributes["name"]
				at := time.Unix(0, m.TimeNano)
				tr.mu.Lock()
				s := tr.seen[name]
				if s == nil {
					s = &engineSteps{}
					tr.seen[name] = s
				}
				switch m.Action {
				case events.ActionCreate:
					s.created = at
				case events.ActionStart:
					s.started = at
				}
				tr.mu.Unlock()
			case <-errs:
				return
			}
		}
	}()
	return tr
}

// steps splits a start that began at began and was answered at answered
// into the engine's steps for the container whose name starts with prefix;
// the events may trail the answer by a moment, so it waits up to a second.
func (tr *engineTrace) steps(b *testing.B, prefix string, began, answered time.Time) (toCreated, toStarted, toAnswer time.Duration) {
	b.Helper()
	for deadline := time.Now().Add(time.Second); ; {
		tr.mu.Lock()
		var found *engineSteps
		for name, s := range tr.seen {
			if strings.HasPrefix(name, prefix) && !s.created.IsZero() && !s.started.IsZero() {
				found = s
				delete(tr.seen, name)
				break
			}
		}
		tr.mu.Unlock()
		if found != nil {
			return found.created.Sub(began), found.started.Sub(found.created), answered.Sub(found.started)
		}
		if time.Now().After(deadline) {
			b.Fatalf("the engine reported no create and start for a container named %s*", prefix)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// stepTimes collects one agent's three steps over the runs.
type stepTimes struct{ created, started, answer []time.Duration }

func (s *stepTimes) add(c, st, a time.Duration) {
	s.created, s.started, s.answer = append(s.created, c), append(s.started, st), append(s.answer, a)
}

func (s *stepTimes) report(b *testing.B, who string) {
	b.ReportMetric(median(s.created), who+"-submit-to-created-ms")
	b.ReportMetric(median(s.started), who+"-created-to-started-ms")
	b.ReportMetric(median(s.answer), who+"-started-to-answer-ms")
}
