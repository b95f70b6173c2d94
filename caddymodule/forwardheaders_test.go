package caddymodule

import (
	"net/http"
	"slices"
	"strings"
	"testing"
)

// TestForwardHeaders: with forward_headers only the listed headers cross,
// plus what HTTP needs; without it the request is passed as it is.
func TestForwardHeaders(t *testing.T) {
	h := &Handler{ForwardHeaders: &[]string{"authorization", "X-Tenant"}}
	if err := h.provisionForwardHeaders(); err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest("POST", "http://app.test/", strings.NewReader("{}"))
	r.Header = http.Header{
		"Authorization":     {"Bearer t"},
		"X-Tenant":          {"a"},
		"Cookie":            {"session=1"},
		"X-Secret":          {"must-not-cross"},
		"Content-Type":      {"application/json"},
		"Content-Encoding":  {"identity"},
		"X-Forwarded-For":   {"1.2.3.4"},
		"Sec-Websocket-Key": {"k"},
	}
	got := h.withForwardHeaders(r)
	if got == r {
		t.Fatal("headers were dropped in place: the access log must see the client's request")
	}
	want := []string{"Authorization", "Content-Encoding", "Content-Type", "X-Forwarded-For", "X-Tenant"}
	if names := forwardedNames(got.Header); !slices.Equal(names, want) {
		t.Fatalf("crossed %v, want %v", names, want)
	}
	if len(r.Header) != 8 {
		t.Fatalf("the client's request was changed: %v", r.Header)
	}
	if got.Context() != r.Context() || got.Host != r.Host || got.Body != r.Body {
		t.Fatal("only the headers may differ")
	}

	// An upgrade keeps its handshake.
	ws, _ := http.NewRequest("GET", "http://app.test/ws", nil)
	ws.Header = http.Header{"Connection": {"Upgrade"}, "Upgrade": {"websocket"}, "Sec-Websocket-Key": {"k"},
		"Sec-Websocket-Version": {"13"}, "X-Secret": {"no"}}
	want = []string{"Connection", "Sec-Websocket-Key", "Sec-Websocket-Version", "Upgrade"}
	if names := forwardedNames(h.withForwardHeaders(ws).Header); !slices.Equal(names, want) {
		t.Fatalf("upgrade crossed %v, want %v", names, want)
	}

	// Nothing to drop: the request itself.
	ok, _ := http.NewRequest("GET", "http://app.test/", nil)
	ok.Header = http.Header{"Authorization": {"x"}}
	if h.withForwardHeaders(ok) != ok {
		t.Fatal("a request with only listed headers must not be copied")
	}

	// Unset: every header crosses.
	all := &Handler{}
	if err := all.provisionForwardHeaders(); err != nil {
		t.Fatal(err)
	}
	if all.withForwardHeaders(r) != r {
		t.Fatal("without forward_headers every header must cross")
	}

	// An empty list: none of the client's own.
	none := &Handler{ForwardHeaders: &[]string{}}
	if err := none.provisionForwardHeaders(); err != nil {
		t.Fatal(err)
	}
	want = []string{"Content-Encoding", "Content-Type", "X-Forwarded-For"}
	if names := forwardedNames(none.withForwardHeaders(r).Header); !slices.Equal(names, want) {
		t.Fatalf("empty list crossed %v, want %v", names, want)
	}

	bad := &Handler{ForwardHeaders: &[]string{"X Bad"}}
	if err := bad.provisionForwardHeaders(); err == nil || !strings.Contains(err.Error(), `forward_headers: "X Bad"`) {
		t.Fatalf("invalid name: %v", err)
	}
}

func forwardedNames(h http.Header) []string {
	var names []string
	for k := range h {
		names = append(names, k)
	}
	slices.Sort(names)
	return names
}
