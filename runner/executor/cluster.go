package executor

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// setupClusterSSH lets the nodes of a multi-node job reach each other
// (runner-protocol.md 9.3): the job key in ~/.ssh/dstack_job, a ~/.ssh/config
// entry per node, and the public key authorized on this node.
func (x *Executor) setupClusterSSH(b api.SubmitBody, user JobUser) error {
	key := b.JobSpec.SSHKey
	if key == nil || len(b.ClusterInfo.JobIPs) < 2 || !user.ProvisionHome {
		return nil
	}
	dir := filepath.Join(user.Home, ".ssh")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	_ = os.Chmod(dir, 0o700)
	own := func(p string) {
		if x.cfg.CanSetUser {
			_ = os.Chown(p, user.UID, user.GID)
		}
	}
	own(dir)
	keyPath := filepath.Join(dir, "dstack_job")
	if err := os.WriteFile(keyPath, []byte(strings.TrimRight(key.Private, "\n")+"\n"), 0o600); err != nil {
		return err
	}
	own(keyPath)
	var cfg strings.Builder
	for _, ip := range b.ClusterInfo.JobIPs {
		if ip == "" {
			continue
		}
		fmt.Fprintf(&cfg, "\nHost %s\n    Port %d\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    IdentityFile %s\n", ip, x.cfg.SSHPort, keyPath)
	}
	cfgPath := filepath.Join(dir, "config")
	f, err := os.OpenFile(cfgPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.WriteString(cfg.String())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	own(cfgPath)
	if x.cfg.AuthorizeKey != nil && key.Public != "" {
		return x.cfg.AuthorizeKey(key.Public)
	}
	return nil
}
