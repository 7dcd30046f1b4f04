package ctl

// The job side of a run: its submit body, code and files, and its start.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/runnerclient"
)

// jobBody is the runner's submit body for a one-node run, shaped as the
// dstack server's.
func jobBody(o RunOptions, id, name string) api.SubmitBody {
	repoData := &api.RepoData{RepoType: api.RepoVirtual}
	body := api.SubmitBody{
		Run: api.Run{ID: id, RunSpec: api.RunSpec{RunName: name, RepoID: "tandem-code", RepoData: repoData}},
		JobSpec: api.JobSpec{JobsPerReplica: 1, Commands: o.Commands, Env: o.Env, RepoData: repoData,
			MaxDuration: int(o.MaxDuration / time.Second)},
		JobSubmission: api.JobSubmission{ID: id},
		ClusterInfo:   api.ClusterInfo{JobIPs: []string{""}, GPUsPerJob: max(o.GPUs, 0)},
		Secrets:       map[string]string{},
		// The job's stdin ends at once, as docker run gives one without -i
		// (on its terminal, where nothing is typed, a job that reads stdin
		// waited forever). dstack's runner ignores this.
		Tandem: &api.SubmitExtras{Stdin: api.StdinNone},
	}
	body.JobSpec.User = jobUser(o.User)
	wd := o.WorkDir
	if wd == "" {
		wd = "/workflow"
	}
	body.JobSpec.WorkingDir = &wd
	body.JobSpec.RepoDir = &wd
	if o.Stdin != nil {
		body.Tandem.Stdin = api.StdinStream
	}
	body.Tandem.TTY = o.TTY
	if o.Detach {
		// Nobody pulls a detached job's output from its runner (attach and
		// logs read what the shim keeps once it is gone): it leaves at the
		// job's end and gives its ports back for the next run.
		body.Tandem.NoPull = true
	}
	return body
}

// jobUser is docker run -u's USER[:GROUP] (names or ids) as the runner's
// job user; nil for "" (the image's).
func jobUser(spec string) *api.JobUser {
	if spec == "" {
		return nil
	}
	u := &api.JobUser{}
	user, group, hasGroup := strings.Cut(spec, ":")
	if n, err := strconv.Atoi(user); err == nil {
		u.UID = &n
	} else {
		u.Username = &user
	}
	if hasGroup {
		if n, err := strconv.Atoi(group); err == nil {
			u.GID = &n
		} else {
			u.Groupname = &group
		}
	}
	return u
}

// prepareJob submits the job and uploads the code.
func prepareJob(ctx context.Context, r *runnerclient.Client, o RunOptions, body api.SubmitBody) error {
	if err := r.Submit(ctx, body); err != nil {
		return submitError(err, o)
	}
	if o.CodeDir != "" {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(tarDir(o.CodeDir, pw)) }()
		err := r.UploadCode(ctx, pr)
		pr.Close()
		if err != nil {
			return fmt.Errorf("upload code from %s: %w", o.CodeDir, err)
		}
	}
	return nil
}

// submitError says why the runner refused a job's submit.
func submitError(err error, o RunOptions) error {
	if o.Network == "host" && errors.Is(err, api.ErrConflict) {
		return withHint(HintBridgeNetwork, fmt.Errorf("submit job: %w: the runner at this port already has a job: another host-network task's (tandem ps)", err))
	}
	return fmt.Errorf("submit job: %w", err)
}

// startJob starts the submitted job; s hears where it runs.
func startJob(ctx context.Context, r *runnerclient.Client, s say) error {
	rr, ok, err := r.Run(ctx)
	if err != nil {
		return fmt.Errorf("start job: %w", err)
	}
	if ok {
		s.jobRunning(rr)
	}
	return nil
}

// jobRunning says where and as whom the job runs, as its runner told.
func (s say) jobRunning(rr api.RunResponse) {
	switch {
	case rr.WorkingDir != "" && rr.Username != "":
		s.status("job running in %s as %s", rr.WorkingDir, rr.Username)
	case rr.WorkingDir != "": // a user the image's /etc/passwd does not name (FROM scratch)
		s.status("job running in %s", rr.WorkingDir)
	}
}

// stdinRunner refuses, before the job is submitted, a runner that cannot
// take a job's input (--interactive): dstack's has no stdin stream, and
// its job would read a terminal nobody types into.
func stdinRunner(ctx context.Context, clk Clock, r *runnerclient.Client) error {
	hc, err := retry(ctx, clk, 30*time.Second, r.Healthcheck)
	if err != nil {
		return fmt.Errorf("runner healthcheck: %w", err)
	}
	if hc.TandemVersion == "" {
		return fmt.Errorf("--interactive: this task's runner (%s %s) takes no input for its job: only Tandem's dstack-runner does", api.Printable(hc.Service), api.Printable(hc.Version))
	}
	return nil
}

// checkJobBody refuses, before anything is made, a job whose submit the
// runner would refuse as too large (413, once the task runs): its
// commands and environment, with the largest named.
func checkJobBody(body api.SubmitBody) error {
	b, err := json.Marshal(body)
	if err != nil {
		return fmt.Errorf("job: %w", err)
	}
	if len(b) <= api.MaxJSONBody {
		return nil
	}
	type part struct {
		what string
		size int
	}
	var parts []part
	for k, v := range body.JobSpec.Env {
		parts = append(parts, part{"env " + k, len(k) + len(v)})
	}
	cmds := 0
	for _, c := range body.JobSpec.Commands {
		cmds += len(c)
	}
	parts = append(parts, part{"the command", cmds})
	slices.SortFunc(parts, func(a, b part) int { return cmp.Compare(b.size, a.size) })
	var big []string
	for _, p := range parts[:min(len(parts), 3)] {
		big = append(big, fmt.Sprintf("%s (%s)", p.what, BytesText(uint64(p.size))))
	}
	return fmt.Errorf("job: its commands and environment take %s as the runner's submit, which takes at most %s; pass large values as files (--code, --mount) (largest: %s)",
		BytesText(uint64(len(b))), BytesText(api.MaxJSONBody), strings.Join(big, ", "))
}
