package caddymodule

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/sluice-tunnel/sluice/internal/hostname"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// AdminAPI serves the state of this process's sluice nodes on Caddy's
// admin API, beside Caddy's own /config and /reverse_proxy/upstreams:
//
//	GET /sluice/status                  every node: limits and their use, sessions, routes, port claims
//	GET /sluice/lookup?host=H           which agent serves a host now (also name=N, server_name=S, port=P)
//	GET /sluice/health                  200 while the process serves
//	GET /sluice/ready                   200 when every node serves, is past its warmup and none drains, else 503 and why
//	POST /sluice/certificates           issue a client certificate for a credential (IssueRequest)
//
// Each GET takes `listen=ADDRESS` to pick one node (its control address or
// id); default: all. The GET endpoints read state only: a lookup never
// runs a load-balancing policy or moves a counter. The admin API listens
// on localhost by default; for a load balancer's probe on a public site,
// use the `sluice_health` handler. POST /sluice/certificates signs with
// the client_auth CA of the running config's sluice app and returns the
// key: whoever reaches the admin API can mint agent credentials, as they
// can load any config already.
type AdminAPI struct {
	// nodes lists the nodes to report; nil: the process's (nodePool).
	nodes func() []*node
	// app returns the sluice app that issues certificates; nil: the
	// running config's (runningApp).
	app func() (*App, error)
}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.sluice",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Routes implements caddy.AdminRouter.
func (a *AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/sluice/status", Handler: caddy.AdminHandlerFunc(a.handleStatus)},
		{Pattern: "/sluice/lookup", Handler: caddy.AdminHandlerFunc(a.handleLookup)},
		{Pattern: "/sluice/health", Handler: caddy.AdminHandlerFunc(a.handleHealth)},
		{Pattern: "/sluice/ready", Handler: caddy.AdminHandlerFunc(a.handleReady)},
		{Pattern: "/sluice/certificates", Handler: caddy.AdminHandlerFunc(a.handleIssue)},
	}
}

// sortedNodes returns the nodes of the process by control address.
func sortedNodes() []*node {
	var out []*node
	nodePool.Range(func(_, v any) bool {
		out = append(out, v.(*node))
		return true
	})
	slices.SortFunc(out, func(a, b *node) int { return strings.Compare(a.addr, b.addr) })
	return out
}

// selected returns the nodes r asks for: those its `listen` names (by
// control address, or by id: nodes of one host share the default id),
// else all. A listen naming none is a 404.
func (a *AdminAPI) selected(r *http.Request) ([]*node, error) {
	list := sortedNodes
	if a.nodes != nil {
		list = a.nodes
	}
	nodes := list()
	want := r.URL.Query().Get("listen")
	if want == "" {
		return nodes, nil
	}
	var picked []*node
	for _, n := range nodes {
		if n.addr == want || nodeID(n) == want {
			picked = append(picked, n)
		}
	}
	if len(picked) > 0 {
		return picked, nil
	}
	return nil, caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no sluice node listens on %q", want)}
}

// onlyGet refuses methods other than GET and HEAD.
func onlyGet(r *http.Request) error {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		return nil
	}
	return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed", r.Method)}
}

// writeJSON answers v with code. Node state changes all the time: no cache
// may keep it.
func writeJSON(w http.ResponseWriter, code int, v any) error {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	if err := json.NewEncoder(w).Encode(v); err != nil {
		return fmt.Errorf("encoding sluice admin response: %w", err)
	}
	return nil
}

// StatusResponse is the answer of GET /sluice/status.
type StatusResponse struct {
	Nodes []NodeStatus `json:"nodes"`
}

func (a *AdminAPI) handleStatus(w http.ResponseWriter, r *http.Request) error {
	if err := onlyGet(r); err != nil {
		return err
	}
	nodes, err := a.selected(r)
	if err != nil {
		return err
	}
	resp := StatusResponse{Nodes: []NodeStatus{}}
	for _, n := range nodes {
		resp.Nodes = append(resp.Nodes, n.status())
	}
	return writeJSON(w, http.StatusOK, resp)
}

// LookupResponse is the answer of GET /sluice/lookup: the query as the
// node matches it, and the answer of each node.
type LookupResponse struct {
	Query map[string]string `json:"query"`
	Nodes []Lookup          `json:"nodes"`
}

func (a *AdminAPI) handleLookup(w http.ResponseWriter, r *http.Request) error {
	if err := onlyGet(r); err != nil {
		return err
	}
	q, shown, err := parseLookup(r.URL.Query())
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	nodes, err := a.selected(r)
	if err != nil {
		return err
	}
	resp := LookupResponse{Query: shown, Nodes: []Lookup{}}
	for _, n := range nodes {
		resp.Nodes = append(resp.Nodes, n.lookup(q))
	}
	return writeJSON(w, http.StatusOK, resp)
}

// errLookupQuery is a lookup that does not ask exactly one question.
var errLookupQuery = errors.New("want exactly one of host, name, server_name or port")

// parseLookup reads the one question of a lookup, normalised as the node
// normalises requests (a Host header's port and case are dropped), and
// returns it for the answer too.
func parseLookup(v url.Values) (lookupQuery, map[string]string, error) {
	var q lookupQuery
	asked := 0
	for _, k := range []string{"host", "name", "server_name", "port"} {
		if v.Has(k) {
			asked++
		}
	}
	if asked != 1 {
		return q, nil, errLookupQuery
	}
	switch {
	case v.Has("host"):
		h, ok := hostname.RoutingKey(v.Get("host"))
		if !ok {
			return q, nil, fmt.Errorf("host: %q is not a host name or IP address", v.Get("host"))
		}
		q.host = h
		return q, map[string]string{"host": h}, nil
	case v.Has("name"):
		q.name = v.Get("name")
		return q, map[string]string{"name": q.name}, nil
	case v.Has("server_name"):
		q.serverName = v.Get("server_name")
		return q, map[string]string{"server_name": q.serverName}, nil
	}
	p, err := strconv.ParseUint(v.Get("port"), 10, 16)
	if err != nil || p == 0 {
		return q, nil, fmt.Errorf("port: %q is not a port number", v.Get("port"))
	}
	q.port = uint32(p)
	return q, map[string]string{"port": strconv.FormatUint(p, 10)}, nil
}

// HealthResponse is the answer of GET /sluice/health and /sluice/ready.
type HealthResponse struct {
	Status string       `json:"status"`           // live, ready or not_ready
	Reason string       `json:"reason,omitempty"` // set when there is no node to ask
	Nodes  []NodeHealth `json:"nodes"`
}

// NodeHealth is one node's readiness.
type NodeHealth struct {
	ID     string `json:"id"`
	Listen string `json:"listen"`
	Ready  bool   `json:"ready"`
	Reason string `json:"reason,omitempty"`
}

// handleHealth is liveness: the process answers, so it is alive, whatever
// its nodes do (a restart would not make a draining node ready sooner).
func (a *AdminAPI) handleHealth(w http.ResponseWriter, r *http.Request) error {
	if err := onlyGet(r); err != nil {
		return err
	}
	nodes, err := a.selected(r)
	if err != nil {
		return err
	}
	return writeJSON(w, http.StatusOK, HealthResponse{Status: "live", Nodes: nodesHealth(nodes)})
}

// handleReady is readiness: 200 when every selected node serves, is past
// its warm-up and none drains (the process exiting included), else 503
// naming each node's reason (node.readiness). With no node at all the
// process tunnels nothing: not ready.
func (a *AdminAPI) handleReady(w http.ResponseWriter, r *http.Request) error {
	if err := onlyGet(r); err != nil {
		return err
	}
	nodes, err := a.selected(r)
	if err != nil {
		return err
	}
	resp := HealthResponse{Status: "ready", Nodes: nodesHealth(nodes)}
	code := http.StatusOK
	if !allReady(resp.Nodes) {
		resp.Status, code = "not_ready", http.StatusServiceUnavailable
	}
	if len(nodes) == 0 {
		resp.Reason = "no sluice node in the running config"
	}
	return writeJSON(w, code, resp)
}

func nodesHealth(nodes []*node) []NodeHealth {
	out := make([]NodeHealth, 0, len(nodes))
	for _, n := range nodes {
		ready, reason := n.readiness()
		out = append(out, NodeHealth{ID: nodeID(n), Listen: n.addr, Ready: ready, Reason: reason})
	}
	return out
}

func allReady(hs []NodeHealth) bool {
	for _, h := range hs {
		if !h.Ready {
			return false
		}
	}
	return len(hs) > 0
}

// maxIssueBody bounds the body of an issue request: three short fields.
const maxIssueBody = 64 << 10

// handleIssue is POST /sluice/certificates: it issues a client
// certificate for a credential of the running config (IssueRequest) and
// answers it with its key (IssuedCertificate).
func (a *AdminAPI) handleIssue(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPost {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s not allowed; use POST", r.Method)}
	}
	var req IssueRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxIssueBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("decoding the request body: %w", err)}
	}
	find := runningApp
	if a.app != nil {
		find = a.app
	}
	app, err := find()
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	out, err := app.issueClientCertificate(req, time.Now())
	if bad := (badIssue{}); errors.As(err, &bad) {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	} else if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusInternalServerError, Err: fmt.Errorf("issuing a certificate: %w", err)}
	}
	return writeJSON(w, http.StatusOK, out)
}

// errNoSluiceApp is an issue request to a process whose running config has
// no sluice app.
var errNoSluiceApp = errors.New("the running config has no sluice app")

// runningApp returns the sluice app of the running config.
func runningApp() (*App, error) {
	v, err := caddy.ActiveContext().AppIfConfigured("sluice")
	if err != nil {
		return nil, errNoSluiceApp
	}
	app, ok := v.(*App)
	if !ok || app.node == nil {
		return nil, errNoSluiceApp
	}
	return app, nil
}

// Interface guards
var _ caddy.AdminRouter = (*AdminAPI)(nil)
