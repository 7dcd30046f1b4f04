package executor

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/runner/account"
)

// setupClusterSSH lets the nodes of a multi-node job reach each other
// (runner-protocol.md 9.3): the job key in ~/.ssh/dstack_job, a ~/.ssh/config
// entry per node (its public key is authorized at submit).
func (x *Executor) setupClusterSSH(b api.SubmitBody, user account.JobUser) error {
	key := b.JobSpec.SSHKey
	if key == nil || len(b.ClusterInfo.JobIPs) < 2 || !user.ProvisionHome {
		return nil
	}
	uid := -1
	if x.cfg.CanSetUser {
		uid = user.UID
	}
	keyRel := filepath.Join(".ssh", "dstack_job")
	if err := homeFile(user.Home, keyRel, []byte(strings.TrimRight(key.Private, "\n")+"\n"), 0o600, uid, user.GID, false); err != nil {
		return err
	}
	keyPath := filepath.Join(user.Home, keyRel)
	var cfg strings.Builder
	for _, ip := range b.ClusterInfo.JobIPs {
		if ip == "" {
			continue
		}
		fmt.Fprintf(&cfg, "\nHost %s\n    Port %d\n    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    IdentityFile %s\n    LogLevel ERROR\n", ip, x.cfg.SSHPort, keyPath)
	}
	// The public key was authorized at submit.
	return homeFile(user.Home, filepath.Join(".ssh", "config"), []byte(cfg.String()), 0o600, uid, user.GID, true)
}
