package ctl

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/shimclient"
)

// TestImageJobDecidesTheCommand: the job's argv, working dir and user as
// a run and its image's config decide them, with the shim's answer from
// GET /api/tasks/{id}/image-config.
func TestImageJobDecidesTheCommand(t *testing.T) {
	answer := `{"image":"sha256:ab","entrypoint":["/entry","a b"],"cmd":["it's"],"working_dir":"/srv","env":[],"user":"app:1001"}`
	asked := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked++
		switch r.URL.Path {
		case "/api/tasks/t1/image-config":
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(answer))
		case "/api/tasks/bare/image-config":
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"image":"sha256:cd","entrypoint":[],"cmd":[],"working_dir":"","env":[],"user":""}`))
		default:
			http.NotFound(w, r) // dstack's shim has no such route
		}
	}))
	defer srv.Close()
	shim, err := shimclient.New(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	body := func(o RunOptions) api.SubmitBody { return jobBody(o, "t1", "n") }
	ctx := context.Background()

	o := RunOptions{Image: "img"}
	b := body(o)
	if err := onShim(shim, nil).imageJob(ctx, "t1", o, &b); err != nil {
		t.Fatal(err)
	}
	u := b.JobSpec.User
	if !slices.Equal(b.JobSpec.Commands, []string{"/entry", "a b", "it's"}) || *b.JobSpec.WorkingDir != "/srv" || *b.JobSpec.RepoDir != "/srv" ||
		u == nil || *u.Username != "app" || *u.GID != 1001 || u.UID != nil || u.Groupname != nil {
		t.Fatalf("the image's command: %q in %q as %+v", b.JobSpec.Commands, *b.JobSpec.WorkingDir, u)
	}

	o = RunOptions{Image: "img", WorkDir: "/mine"}
	b = body(o)
	uid := 7
	b.JobSpec.User = &api.JobUser{UID: &uid}
	if err := onShim(shim, nil).imageJob(ctx, "t1", o, &b); err != nil {
		t.Fatal(err)
	}
	if *b.JobSpec.WorkingDir != "/mine" || *b.JobSpec.User.UID != 7 || b.JobSpec.User.Username != nil {
		t.Fatalf("the run's dir and user must win: %q %+v", *b.JobSpec.WorkingDir, b.JobSpec.User)
	}

	before := asked
	for _, tc := range []struct {
		o    RunOptions
		want []string
	}{
		{RunOptions{Commands: []string{"echo", "hi"}}, []string{"echo", "hi"}},
		{RunOptions{Entrypoint: []string{"/bin/sh", "-c"}, Commands: []string{"exit 5"}}, []string{"/bin/sh", "-c", "exit 5"}},
		{RunOptions{Entrypoint: []string{"/bin/true"}}, []string{"/bin/true"}},
	} {
		b := body(tc.o)
		if err := onShim(shim, nil).imageJob(ctx, "t1", tc.o, &b); err != nil || !slices.Equal(b.JobSpec.Commands, tc.want) || *b.JobSpec.WorkingDir != "/workflow" {
			t.Errorf("%+v: %q in %q, %v (want %q)", tc.o, b.JobSpec.Commands, *b.JobSpec.WorkingDir, err, tc.want)
		}
	}
	if asked != before {
		t.Error("a run with a command or an entrypoint asked the shim for the image's config")
	}

	o = RunOptions{Image: "bare:1"}
	b = body(o)
	err = onShim(shim, nil).imageJob(ctx, "bare", o, &b)
	if !errors.Is(err, ErrNoImageCommand) || err.Error() != "no command: image bare:1 has no ENTRYPOINT or CMD: give the command to run" {
		t.Fatalf("an image with neither: %v", err)
	}
	b = body(o)
	if err := onShim(shim, nil).imageJob(ctx, "other", o, &b); !errors.Is(err, ErrNoImageCommand) || !strings.Contains(err.Error(), "only Tandem's dstack-shim") {
		t.Fatalf("a shim without the route: %v", err)
	}
}

func TestParseUser(t *testing.T) {
	n := func(v int) *int { return &v }
	s := func(v string) *string { return &v }
	for in, want := range map[string]api.JobUser{
		"1000":       {UID: n(1000)},
		"app":        {Username: s("app")},
		"1000:100":   {UID: n(1000), GID: n(100)},
		"app:staff":  {Username: s("app"), Groupname: s("staff")},
		"0:wheel":    {UID: n(0), Groupname: s("wheel")},
		"jovyan:100": {Username: s("jovyan"), GID: n(100)},
	} {
		got, err := ParseUser(in)
		if err != nil {
			t.Errorf("%q: %v", in, err)
			continue
		}
		if !eqPtr(got.UID, want.UID) || !eqPtr(got.GID, want.GID) || !eqPtr(got.Username, want.Username) || !eqPtr(got.Groupname, want.Groupname) {
			t.Errorf("%q: %+v, want %+v", in, got, want)
		}
	}
	for _, bad := range []string{":1", "1:", "a:b:c", "-1", "1:-5", ""} {
		if _, err := ParseUser(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func eqPtr[T comparable](a, b *T) bool {
	return (a == nil) == (b == nil) && (a == nil || *a == *b)
}
