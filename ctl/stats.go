package ctl

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// Stat is one task's resource use as `tandem stats` shows it: the CPU it
// used between two samples, its memory and GPUs at the second.
type Stat struct {
	Name string `json:"name"`
	ID   string `json:"id"`
	// CPUPercent is CPU time over wall time, in per cent of one core (250:
	// two and a half cores busy), as docker stats counts; nil until two
	// samples of the same runner are in.
	CPUPercent *float64 `json:"cpu_percent"`
	// CPULimit and MemoryLimit are the task's limits as submitted (cores,
	// bytes; 0: none).
	CPULimit    float64 `json:"cpu_limit,omitempty"`
	MemoryBytes uint64  `json:"memory_bytes"` // the working set: what the kernel cannot reclaim
	MemoryLimit int64   `json:"memory_limit,omitempty"`
	// GPUs are the task's GPUs' use, as its runner reads them.
	GPUs []api.GPUMetrics `json:"gpus"`
	// Error says why the figures are missing (the task does not run, its
	// runner did not answer).
	Error string `json:"error,omitempty"`
}

// Sampler reads tasks' resource use from their runners; each Sample
// reports the CPU used since the one before it. Not safe for concurrent
// use.
type Sampler struct {
	c    *Client
	refs []string
	last map[string]api.MetricsResponse // the previous sample, by task id
	// The runners' clients are kept from sample to sample, as the shim's
	// is: each holds its kept-alive connections (a stream refreshing every
	// 2 s would otherwise leave one idle connection per task and round open
	// for 90 s).
	mu      sync.Mutex                      // guards runners
	runners map[string]*runnerclient.Client // by address
}

// NewSampler samples the tasks refs name (names, ids or unique id
// prefixes) or, with none, every task whose job runs.
func (c *Client) NewSampler(refs []string) *Sampler {
	return &Sampler{c: c, refs: refs, last: map[string]api.MetricsResponse{}, runners: map[string]*runnerclient.Client{}}
}

// statsParallel bounds the runners asked at once.
const statsParallel = 8

// statsTimeout bounds one runner's answer: a runner that does not answer
// shows as an error row, not a stalled table.
const statsTimeout = 5 * time.Second

// Sample asks each task's runner for its use once. The set of tasks is
// read again every time: with no refs, tasks that started since show up
// and ended ones leave. A ref that names no task is an error.
func (s *Sampler) Sample(ctx context.Context) ([]Stat, error) {
	all, err := s.c.Tasks(ctx)
	if err != nil {
		return nil, err
	}
	var infos []api.TaskInfoResponse
	if len(s.refs) == 0 {
		for _, info := range all {
			if info.Status == api.TaskRunning && !JobEnded(info) {
				infos = append(infos, info)
			}
		}
		slices.SortStableFunc(infos, func(a, b api.TaskInfoResponse) int { return int(submitted(b) - submitted(a)) })
	} else {
		for _, ref := range s.refs {
			info, err := Match(all, ref)
			if err != nil {
				return nil, err
			}
			if !slices.ContainsFunc(infos, func(i api.TaskInfoResponse) bool { return i.ID == info.ID }) {
				infos = append(infos, info)
			}
		}
	}
	out := make([]Stat, len(infos))
	cur := make([]*api.MetricsResponse, len(infos))
	var wg sync.WaitGroup
	sem := make(chan struct{}, statsParallel)
	for i, info := range infos {
		out[i] = Stat{Name: TaskName(info), ID: info.ID, GPUs: []api.GPUMetrics{}}
		if d := info.Tandem; d != nil {
			out[i].CPULimit, out[i].MemoryLimit = d.CPU, d.Memory
		}
		if info.Status != api.TaskRunning || JobEnded(info) {
			out[i].Error = notRunning(info)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			m, err := s.metrics(ctx, info)
			if err != nil {
				out[i].Error = err.Error()
				return
			}
			cur[i] = &m
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	next := map[string]api.MetricsResponse{}
	for i, m := range cur {
		if m == nil {
			continue
		}
		st := &out[i]
		st.MemoryBytes = m.MemoryWorkingSetBytes
		if m.GPUs != nil {
			st.GPUs = m.GPUs
		}
		if prev, ok := s.last[st.ID]; ok {
			if p, ok := CPUPercent(prev, *m); ok {
				st.CPUPercent = &p
			}
		}
		next[st.ID] = *m
	}
	s.last = next
	return out, nil
}

// metrics asks one task's runner, within statsTimeout.
func (s *Sampler) metrics(ctx context.Context, info api.TaskInfoResponse) (api.MetricsResponse, error) {
	r, addr, err := s.runner(info)
	if err != nil {
		return api.MetricsResponse{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, statsTimeout)
	defer cancel()
	m, err := r.Metrics(ctx)
	if err != nil {
		return m, fmt.Errorf("runner at %s: %w", addr, err)
	}
	return m, nil
}

// runner is the client of info's runner, made once per address.
func (s *Sampler) runner(info api.TaskInfoResponse) (*runnerclient.Client, string, error) {
	addr, err := runnerAddr(s.c.cfg.Shim, info, s.c.cfg.Ports.HTTP)
	if err != nil {
		return nil, "", err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.runners[addr]; ok {
		return r, addr, nil
	}
	r, err := runnerclient.NewWithDialer(addr, s.c.cfg.Dial)
	if err != nil {
		return nil, addr, err
	}
	s.runners[addr] = r
	return r, addr, nil
}

func notRunning(info api.TaskInfoResponse) string {
	if JobEnded(info) {
		return fmt.Sprintf("the job ended (%s)", info.Tandem.Job.State)
	}
	return fmt.Sprintf("the task is %s", info.Status)
}

func submitted(info api.TaskInfoResponse) int64 {
	if info.Tandem != nil {
		return info.Tandem.SubmittedAt
	}
	return 0
}

// CPUPercent is the CPU a runner's container used between two of its
// samples, in per cent of one core; false when the two do not make an
// interval (the same or an older time, or a usage counter that went back:
// a restarted runner or container).
func CPUPercent(prev, cur api.MetricsResponse) (float64, bool) {
	dt := cur.TimestampMicro - prev.TimestampMicro
	if dt <= 0 || cur.CPUUsageMicro < prev.CPUUsageMicro {
		return 0, false
	}
	return float64(cur.CPUUsageMicro-prev.CPUUsageMicro) / float64(dt) * 100, true
}
