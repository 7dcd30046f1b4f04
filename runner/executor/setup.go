package executor

// Before the job runs: its repo, its files and what it finds around it.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/ident"
	"github.com/tandem-run/tandem/runner/account"
	"github.com/tandem-run/tandem/runner/repo"
)

func (x *Executor) setupRepo(body api.SubmitBody, user account.JobUser, wd string, codeBlob bool, owner repo.Owner) (string, error) {
	if body.JobSpec.RepoDir == nil {
		return "", errors.New("repo_dir is not set")
	}
	dir, err := ExpandPath(*body.JobSpec.RepoDir, user.Home, wd)
	if err != nil {
		return "", err
	}
	rd := body.JobSpec.RepoData
	if rd == nil {
		rd = body.Run.RunSpec.RepoData
	}
	repoType := api.RepoVirtual
	if rd != nil && rd.RepoType != "" {
		repoType = rd.RepoType
	}
	blob := filepath.Join(x.cfg.TempDir, "repo_blobs", blobName(body.Run.RunSpec.RepoID))
	defer os.RemoveAll(filepath.Join(x.cfg.TempDir, "repo_blobs"))
	action := body.JobSpec.RepoExistsAction
	if action == "" {
		action = "skip"
	}
	return dir, repo.Setup(repo.Spec{
		Dir:         dir,
		Type:        repoType,
		Data:        rd,
		Credentials: body.RepoCredentials,
		Blob:        blob,
		HasBlob:     codeBlob,
		Exists:      action,
		Single:      body.JobSpec.SingleBranch,
		Owner:       owner,
		Log:         x.runnerLog,
	})
}

func blobName(id string) string {
	if ident.ArchiveID(id) == nil {
		return id
	}
	return "code"
}

func (x *Executor) setupFiles(body api.SubmitBody, user account.JobUser, wd string, owner repo.Owner) error {
	dir := filepath.Join(x.cfg.TempDir, "file_archives")
	defer os.RemoveAll(dir)
	for _, fa := range body.JobSpec.FileArchives {
		dest, err := ExpandPath(fa.Path, user.Home, wd)
		if err != nil {
			return err
		}
		if err := ident.ArchiveID(fa.ID); err != nil {
			return err
		}
		f, err := os.Open(filepath.Join(dir, fa.ID))
		if err != nil {
			return fmt.Errorf("archive %s for %s: %w", fa.ID, fa.Path, err)
		}
		if err := MkdirOwned(filepath.Dir(dest), owner.UID, owner.GID); err != nil {
			f.Close()
			return err
		}
		err = repo.ExtractArchive(f, dest, owner)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", fa.Path, err)
		}
	}
	return nil
}

// prepareJob writes what the job finds around it (its environment in the
// profile, the hostfile, its working dir) and returns its environment.
func (x *Executor) prepareJob(body api.SubmitBody, user account.JobUser, wd, repoDir string) ([]string, error) {
	env := JobEnv(x.cfg.BaseEnv, body, repoDir, wd, x.cfg.Paths.HostfilePath(), user.Home)
	list := account.EnvList(env) // the job's and SSH sessions' (read only by both)
	x.mu.Lock()
	x.jobEnv = list
	x.mu.Unlock()
	if err := WriteProfile(x.cfg.Paths, env); err != nil {
		x.runnerLog.Warn("write profile", "err", err)
	}
	if err := WriteHostfile(x.cfg.Paths, body.ClusterInfo); err != nil {
		return nil, err
	}
	uid, gid := -1, -1
	if x.cfg.CanSetUser {
		uid, gid = user.UID, user.GID
	}
	if err := MkdirOwned(wd, uid, gid); err != nil {
		return nil, fmt.Errorf("create working dir %s: %w", wd, err)
	}
	_ = unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY})
	return list, nil
}
