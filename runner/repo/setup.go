package repo

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"

	"github.com/bluekeyes/go-gitdiff/gitdiff"
	"github.com/go-git/go-git/v5"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/transport"
	githttp "github.com/go-git/go-git/v5/plumbing/transport/http"
	gitssh "github.com/go-git/go-git/v5/plumbing/transport/ssh"
	"golang.org/x/crypto/ssh"

	"github.com/tandem-run/tandem/api"
)

// Spec is what to put in the repo dir.
type Spec struct {
	Dir         string
	Type        string // remote, local, virtual
	Data        *api.RepoData
	Credentials *api.RepoCredentials
	Blob        string // path of the uploaded code blob
	HasBlob     bool
	Exists      string // "error" or "skip": what to do with a non-empty dir
	Single      bool   // single-branch clone
	Owner       Owner
	Log         *slog.Logger
}

// Setup prepares the repo dir (runner-protocol.md 7.1).
func Setup(s Spec) error {
	entries, err := os.ReadDir(s.Dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("inspect repo dir: %w", err)
	}
	switch {
	case len(entries) == 0:
	case len(entries) == 1 && entries[0].Name() == "lost+found":
		// A fresh volume: set lost+found aside, put it back afterwards.
		tmp, err := os.MkdirTemp(filepath.Dir(s.Dir), ".lost+found-")
		if err != nil {
			return fmt.Errorf("move lost+found aside: %w", err)
		}
		if err := os.Rename(filepath.Join(s.Dir, "lost+found"), filepath.Join(tmp, "lost+found")); err != nil {
			return fmt.Errorf("move lost+found aside: %w", err)
		}
		defer func() {
			_ = os.Rename(filepath.Join(tmp, "lost+found"), filepath.Join(s.Dir, "lost+found"))
			_ = os.Remove(tmp)
		}()
	default:
		if s.Exists == "error" {
			return fmt.Errorf("repo dir is not empty: %s", s.Dir)
		}
		if s.Log != nil {
			s.Log.Info("repo dir is not empty; skipping repo setup", "dir", s.Dir)
		}
		return nil
	}
	switch s.Type {
	case api.RepoRemote:
		if err := s.clone(); err != nil {
			return err
		}
		if s.HasBlob {
			if err := applyDiffFile(s.Dir, s.Blob); err != nil {
				return err
			}
		}
	case api.RepoLocal, api.RepoVirtual:
		if !s.HasBlob {
			return nil
		}
		f, err := os.Open(s.Blob)
		if err != nil {
			return fmt.Errorf("code blob: %w", err)
		}
		defer f.Close()
		if err := ExtractTar(f, s.Dir, s.Owner); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unknown RepoType %q", s.Type)
	}
	if s.Owner.UID >= 0 {
		_ = filepath.WalkDir(s.Dir, func(p string, _ fs.DirEntry, err error) error {
			if err == nil {
				_ = os.Lchown(p, s.Owner.UID, s.Owner.GID)
			}
			return nil
		})
	}
	return nil
}

func (s Spec) clone() error {
	if s.Credentials == nil || s.Credentials.CloneURL == "" {
		return errors.New("remote repo without clone credentials")
	}
	auth, err := cloneAuth(s.Credentials)
	if err != nil {
		return err
	}
	opts := &git.CloneOptions{URL: s.Credentials.CloneURL, Auth: auth, RecurseSubmodules: git.DefaultSubmoduleRecursionDepth, SingleBranch: s.Single}
	branch, hash := "", ""
	if s.Data != nil {
		branch, hash = s.Data.RepoBranch, s.Data.RepoHash
	}
	if branch != "" {
		opts.ReferenceName = plumbing.NewBranchReferenceName(branch)
	}
	if err := os.MkdirAll(s.Dir, 0o755); err != nil {
		return fmt.Errorf("clone: %w", err)
	}
	r, err := git.PlainClone(s.Dir, false, opts)
	if err != nil {
		return fmt.Errorf("clone %s: %w", redact(s.Credentials.CloneURL), err)
	}
	if hash != "" {
		head, err := r.Head()
		if err != nil {
			return fmt.Errorf("clone: %w", err)
		}
		if head.Hash().String() != hash {
			wt, err := r.Worktree()
			if err != nil {
				return fmt.Errorf("checkout: %w", err)
			}
			h, err := r.ResolveRevision(plumbing.Revision(hash))
			if err != nil {
				return fmt.Errorf("checkout %s: %w", hash, err)
			}
			if err := wt.Checkout(&git.CheckoutOptions{Hash: *h, Force: true}); err != nil {
				return fmt.Errorf("checkout %s: %w", hash, err)
			}
		}
	}
	if s.Data != nil && (s.Data.RepoConfigName != "" || s.Data.RepoConfigEmail != "") {
		cfg, err := r.Config()
		if err == nil {
			cfg.User.Name, cfg.User.Email = s.Data.RepoConfigName, s.Data.RepoConfigEmail
			_ = r.SetConfig(cfg)
		}
	}
	return nil
}

func cloneAuth(c *api.RepoCredentials) (transport.AuthMethod, error) {
	ep, err := transport.NewEndpoint(c.CloneURL)
	if err != nil {
		return nil, fmt.Errorf("clone url: %w", err)
	}
	switch ep.Protocol {
	case "https":
		if c.OAuthToken == "" {
			return nil, nil
		}
		return &githttp.BasicAuth{Username: "oauth2", Password: c.OAuthToken}, nil
	case "ssh":
		if c.PrivateKey == "" {
			return nil, errors.New("ssh clone url without a private key")
		}
		keys, err := gitssh.NewPublicKeys("git", []byte(c.PrivateKey), "")
		if err != nil {
			return nil, fmt.Errorf("repo private key: %w", err)
		}
		keys.HostKeyCallback = ssh.InsecureIgnoreHostKey() //nolint:gosec // as dstack: repo hosts are not pinned
		return keys, nil
	case "git", "file":
		return nil, nil
	}
	return nil, fmt.Errorf("unsupported clone url scheme %q", ep.Protocol)
}

func redact(u string) string {
	if p, err := url.Parse(u); err == nil {
		return p.Redacted()
	}
	return u
}

// applyDiffFile applies a git diff (possibly empty) to the checkout in dir.
func applyDiffFile(dir, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("code diff: %w", err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return nil
	}
	files, _, err := gitdiff.Parse(bytes.NewReader(data))
	if err != nil {
		return fmt.Errorf("parse diff: %w", err)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return fmt.Errorf("apply diff: %w", err)
	}
	defer root.Close()
	for _, f := range files {
		if err := applyFile(root, f); err != nil {
			return err
		}
	}
	return nil
}

func applyFile(root *os.Root, f *gitdiff.File) error {
	for _, name := range []string{f.OldName, f.NewName} {
		if name != "" {
			if _, err := cleanEntry(name); err != nil {
				return fmt.Errorf("apply diff: %w", err)
			}
		}
	}
	var src []byte
	mode := fs.FileMode(0o644)
	if !f.IsNew {
		b, err := root.ReadFile(f.OldName)
		if err != nil {
			return fmt.Errorf("apply diff to %s: %w", f.OldName, err)
		}
		src = b
		if fi, err := root.Stat(f.OldName); err == nil {
			mode = fi.Mode().Perm()
		}
	}
	if f.IsDelete {
		if err := root.Remove(f.OldName); err != nil {
			return fmt.Errorf("apply diff: delete %s: %w", f.OldName, err)
		}
		return nil
	}
	var out bytes.Buffer
	if err := gitdiff.Apply(&out, bytes.NewReader(src), f); err != nil {
		return fmt.Errorf("apply diff to %s: %w", f.NewName, err)
	}
	if f.NewMode != 0 {
		mode = f.NewMode.Perm()
	}
	if dir := filepath.Dir(f.NewName); dir != "." {
		if err := root.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("apply diff: %w", err)
		}
	}
	if f.IsRename && f.OldName != f.NewName {
		_ = root.Remove(f.OldName)
	}
	if err := root.WriteFile(f.NewName, out.Bytes(), mode); err != nil {
		return fmt.Errorf("apply diff: write %s: %w", f.NewName, err)
	}
	return root.Chmod(f.NewName, mode)
}
