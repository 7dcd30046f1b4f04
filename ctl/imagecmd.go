package ctl

// The image's own command: a run with no command runs the image's
// ENTRYPOINT and CMD, as docker run does and the dstack server does for a
// task with no commands.

import (
	"context"
	"errors"
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// ErrNoImageCommand means a run gave no command and its image has none
// (no ENTRYPOINT, no CMD): there is nothing to run.
var ErrNoImageCommand = errors.New("no command")

// checkCommand refuses, before anything is made, a run that can have no
// command: an entrypoint given as empty (docker's --entrypoint "") with no
// command. A run with neither is the image's command, found once its task
// runs (imageJob).
func checkCommand(o RunOptions) error {
	if o.Entrypoint != nil && len(o.Entrypoint) == 0 && len(o.Commands) == 0 {
		return fmt.Errorf("%w: the entrypoint is empty and no command is given: nothing to run", ErrNoImageCommand)
	}
	return nil
}

// imageJob decides body's command where the run did not give it all:
//   - an entrypoint given (Entrypoint, docker's --entrypoint) runs with
//     the run's command as its arguments, the image's CMD unused, as
//     docker does;
//   - no command, no entrypoint: the image's ENTRYPOINT then CMD, as its
//     task's shim read them from the image (argv, exact: the runner
//     executes the job's commands as argv, as dstack's does, with no
//     shell), in the image's WORKDIR unless the run named a working dir,
//     as the image's USER unless the job names a user. The image's ENV
//     is the container's already, which the job inherits.
//
// A run with a command and no entrypoint is left as it is (the command
// replaces the image's ENTRYPOINT, as a dstack task's commands do).
func (c *Client) imageJob(ctx context.Context, taskID string, o RunOptions, body *api.SubmitBody) error {
	if o.Entrypoint != nil {
		body.JobSpec.Commands = slices.Concat(o.Entrypoint, o.Commands)
		return nil
	}
	if len(o.Commands) > 0 {
		return nil
	}
	cfg, err := retry(ctx, c.clk, waitPatience, func(ctx context.Context) (api.TaskImageConfig, error) {
		return c.shim.TaskImageConfig(ctx, taskID)
	})
	switch {
	case errors.Is(err, api.ErrNotFound):
		return fmt.Errorf("%w given, and this shim cannot say the image's ENTRYPOINT and CMD (only Tandem's dstack-shim does): give the command", ErrNoImageCommand)
	case err != nil:
		return fmt.Errorf("the image's command: %w", err)
	}
	argv := slices.Concat(cfg.Entrypoint, cfg.Cmd)
	if len(argv) == 0 {
		return fmt.Errorf("%w: image %s has no ENTRYPOINT or CMD: give the command to run", ErrNoImageCommand, api.Printable(o.Image))
	}
	body.JobSpec.Commands = argv
	if o.WorkDir == "" && cfg.WorkingDir != "" {
		wd := cfg.WorkingDir
		if !path.IsAbs(wd) {
			return fmt.Errorf("image %s: its WORKDIR %q is not absolute", api.Printable(o.Image), api.Printable(wd))
		}
		body.JobSpec.WorkingDir, body.JobSpec.RepoDir = &wd, &wd
	}
	if body.JobSpec.User == nil && cfg.User != "" {
		u, err := ParseUser(cfg.User)
		if err != nil {
			return fmt.Errorf("image %s: its USER: %w", api.Printable(o.Image), err)
		}
		body.JobSpec.User = u
	}
	c.say.status("running the image's command: %s", api.Printable(quoteArgv(argv)))
	return checkJobBody(*body)
}

// ParseUser reads docker's USER[:GROUP], each a name or a numeric id, as
// the dstack server reads an image's USER (UnixUser.parse).
func ParseUser(s string) (*api.JobUser, error) {
	user, group, hasGroup := strings.Cut(s, ":")
	if strings.Contains(group, ":") {
		return nil, fmt.Errorf("%q: too many parts (USER[:GROUP])", s)
	}
	u := &api.JobUser{}
	part := func(v, what string, id **int, name **string) error {
		if v == "" {
			return fmt.Errorf("%q: empty %s name or id", s, what)
		}
		if n, err := strconv.Atoi(v); err == nil {
			if n < 0 {
				return fmt.Errorf("%q: negative %s id", s, what)
			}
			*id = &n
			return nil
		}
		if strings.HasPrefix(v, "-") || strings.HasPrefix(v, "+") {
			return fmt.Errorf("%q: %s is not a name or a uid/gid", s, what)
		}
		*name = &v
		return nil
	}
	if err := part(user, "user", &u.UID, &u.Username); err != nil {
		return nil, err
	}
	if hasGroup {
		if err := part(group, "group", &u.GID, &u.Groupname); err != nil {
			return nil, err
		}
	}
	return u, nil
}
