package executor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// Paths are the files the runner writes outside its temp dir; injectable so
// tests can run without touching /.
type Paths struct {
	DstackDir  string // "/dstack"
	EtcProfile string // "/etc/profile"
}

// ProfilePath is where the job environment is exported for login shells.
func (p Paths) ProfilePath() string { return filepath.Join(p.DstackDir, "profile") }

// HostfilePath is the MPI hostfile.
func (p Paths) HostfilePath() string { return filepath.Join(p.DstackDir, "mpi", "hostfile") }

// JobEnv builds the job environment in dstack's order (later wins): the
// runner's own environment, the DSTACK_* variables, secrets, job_spec.env;
// exported bash functions are dropped and HOME is the job user's.
func JobEnv(base []string, b api.SubmitBody, repoDir, workDir, hostfile, home string) map[string]string {
	env := map[string]string{}
	for _, kv := range base {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	gpusNum := 0
	for _, n := range b.ClusterInfo.GPUsPerNode {
		gpusNum += n
	}
	if len(b.ClusterInfo.GPUsPerNode) == 0 {
		gpusNum = b.JobSpec.JobsPerReplica * b.ClusterInfo.GPUsPerJob
	}
	for k, v := range map[string]string{
		"DSTACK_RUN_ID":         b.Run.ID,
		"DSTACK_JOB_ID":         b.JobSubmission.ID,
		"DSTACK_RUN_NAME":       b.Run.RunSpec.RunName,
		"DSTACK_REPO_ID":        b.Run.RunSpec.RepoID,
		"DSTACK_REPO_DIR":       repoDir,
		"DSTACK_WORKING_DIR":    workDir,
		"DSTACK_NODES_IPS":      strings.Join(b.ClusterInfo.JobIPs, "\n"),
		"DSTACK_MASTER_NODE_IP": b.ClusterInfo.MasterJobIP,
		"DSTACK_NODE_RANK":      strconv.Itoa(b.JobSpec.JobNum),
		"DSTACK_NODES_NUM":      strconv.Itoa(b.JobSpec.JobsPerReplica),
		"DSTACK_GPUS_PER_NODE":  strconv.Itoa(b.ClusterInfo.GPUsPerJob),
		"DSTACK_GPUS_NUM":       strconv.Itoa(gpusNum),
		"DSTACK_MPI_HOSTFILE":   hostfile,
	} {
		env[k] = v
	}
	for k, v := range b.Secrets {
		env[k] = v
	}
	for k, v := range b.JobSpec.Env {
		env[k] = v
	}
	for k := range env {
		if strings.HasPrefix(k, "BASH_FUNC_") && (strings.HasSuffix(k, "%%") || strings.HasSuffix(k, "()")) {
			delete(env, k)
		}
	}
	env["HOME"] = home
	return env
}

var shellIdent = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

var profileSkip = map[string]bool{"HOSTNAME": true, "USER": true, "HOME": true, "SHELL": true, "SHLVL": true, "PWD": true, "_": true}

// WriteProfile writes /dstack/profile (export lines and a cd to the working
// dir) and hooks it into /etc/profile once.
func WriteProfile(p Paths, env map[string]string) error {
	var b strings.Builder
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		if profileSkip[k] || !shellIdent.MatchString(k) {
			continue
		}
		fmt.Fprintf(&b, "export %s='%s'\n", k, strings.ReplaceAll(env[k], "'", `'"'"'`))
	}
	b.WriteString("cd \"$DSTACK_WORKING_DIR\"\n")
	if err := os.MkdirAll(p.DstackDir, 0o755); err != nil {
		return fmt.Errorf("profile: %w", err)
	}
	if err := os.WriteFile(p.ProfilePath(), []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("profile: %w", err)
	}
	hook := ". '" + p.ProfilePath() + "'"
	cur, err := os.ReadFile(p.EtcProfile)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("profile hook: %w", err)
	}
	if slices.Contains(strings.Split(string(cur), "\n"), hook) {
		return nil
	}
	f, err := os.OpenFile(p.EtcProfile, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("profile hook: %w", err)
	}
	defer f.Close()
	_, err = f.WriteString("\n" + hook + "\n")
	return err
}

// WriteHostfile writes the MPI hostfile: one "<ip> slots=<n>" line per node
// when every IP is known, else an empty file.
func WriteHostfile(p Paths, ci api.ClusterInfo) error {
	if err := os.MkdirAll(filepath.Dir(p.HostfilePath()), 0o755); err != nil {
		return fmt.Errorf("hostfile: %w", err)
	}
	var b strings.Builder
	complete := len(ci.JobIPs) > 0
	for _, ip := range ci.JobIPs {
		if ip == "" {
			complete = false
		}
	}
	if complete {
		if len(ci.GPUsPerNode) > 0 && len(ci.GPUsPerNode) != len(ci.JobIPs) {
			return fmt.Errorf("hostfile: %d nodes but %d GPU counts", len(ci.JobIPs), len(ci.GPUsPerNode))
		}
		for i, ip := range ci.JobIPs {
			slots := ci.GPUsPerJob
			if len(ci.GPUsPerNode) > 0 {
				slots = ci.GPUsPerNode[i]
			}
			if slots > 0 {
				fmt.Fprintf(&b, "%s slots=%d\n", ip, slots)
			} else {
				fmt.Fprintf(&b, "%s\n", ip)
			}
		}
	}
	return os.WriteFile(p.HostfilePath(), []byte(b.String()), 0o644)
}

// ExpandPath resolves "~" and "~/x" against home; relative results are
// joined to base (empty base: they are an error).
func ExpandPath(path, home, base string) (string, error) {
	switch {
	case path == "~":
		path = home
	case strings.HasPrefix(path, "~/"):
		path = filepath.Join(home, path[2:])
	case strings.HasPrefix(path, "~"):
		return "", fmt.Errorf("%q: ~user paths are not supported", path)
	}
	if !filepath.IsAbs(path) {
		if base == "" {
			return "", fmt.Errorf("%q: must be absolute", path)
		}
		path = filepath.Join(base, path)
	}
	return filepath.Clean(path), nil
}
