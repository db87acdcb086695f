// The suffix drafters' texts, n-gram index, lookup and vote trie, compiled: what
// ``multispec/drafters/{index,lookup,trie}.py`` do for deterministic drafts, with the same
// arithmetic in the same order, so the drafts are the same trees, node for node and bit for bit
// (tested against the Python path). A Python module (pybind11), not torch operators: its state
// lives across steps and its arguments are small Python lists.
//
// Why: at one request of 16 samples a drafted step spent about 1.3 ms of its 26 in the drafter's
// Python (inserting every vote into a trie of per-node lists and dicts, the heap over it, the
// index of every new n-gram); the same work here takes tens of microseconds.
//
// Built without floating-point contraction (-ffp-contract=off, see kernels/__init__.py): a
// product added to a sum stays two roundings, as in Python.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <queue>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr double UNKNOWN = -1.0;  // a probability never computed (index.UNKNOWN)
constexpr int MAX_N = 8;          // longest n-gram the compiled index keys

using Alternative = std::optional<std::pair<std::vector<int64_t>, std::vector<double>>>;

struct Text {
  std::vector<int64_t> tokens;
  std::vector<double> probs;
  // The kept alternatives of position i: alt_tokens/alt_probs[alt_start[i] .. alt_start[i] + alt_len[i]]
  // (length 0: none).
  std::vector<int64_t> alt_start;
  std::vector<int32_t> alt_len;
  std::vector<int64_t> alt_tokens;
  std::vector<double> alt_probs;

  void append(int64_t token, double prob) {
    tokens.push_back(token);
    probs.push_back(prob);
    alt_start.push_back(static_cast<int64_t>(alt_tokens.size()));
    alt_len.push_back(0);
  }
};

struct Key {
  int64_t t[MAX_N];
  int32_t n;
  bool operator==(const Key& o) const {
    return n == o.n && std::memcmp(t, o.t, sizeof(int64_t) * n) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(k.n);
    for (int i = 0; i < k.n; ++i) {
      h ^= static_cast<uint64_t>(k.t[i]) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

struct Occurrence {
  int32_t text;
  int64_t end;
};

// index.NgramIndex: every n-gram's most recent occurrences, older ones dropped in batches.
struct Index {
  int min_n, max_n, keep;
  std::unordered_map<Key, std::vector<Occurrence>, KeyHash> table;

  void add(const std::vector<Text>& texts, int32_t source, int64_t first_end) {
    const std::vector<int64_t>& tokens = texts[source].tokens;
    const int64_t length = static_cast<int64_t>(tokens.size());
    const size_t most = 2 * static_cast<size_t>(keep);
    Key key;
    for (int64_t end = std::max<int64_t>(first_end, min_n); end <= length; ++end) {
      const int width = static_cast<int>(std::min<int64_t>(max_n, end));
      for (int n = min_n; n <= width; ++n) {
        key.n = n;
        std::memcpy(key.t, tokens.data() + (end - n), sizeof(int64_t) * n);
        std::vector<Occurrence>& occurrences = table[key];
        occurrences.push_back({source, end});
        if (occurrences.size() > most) {
          occurrences.erase(occurrences.begin(), occurrences.end() - keep);
        }
      }
    }
  }

  // The last ``keep`` occurrences of the key, oldest first: [first, last).
  std::pair<const Occurrence*, const Occurrence*> recent(const Key& key) const {
    auto found = table.find(key);
    if (found == table.end() || found->second.empty()) return {nullptr, nullptr};
    const std::vector<Occurrence>& all = found->second;
    const size_t from = all.size() > static_cast<size_t>(keep) ? all.size() - keep : 0;
    return {all.data() + from, all.data() + all.size()};
  }
};

// A prompt's samples: text 0 is the prompt, index 0 the prompt's; the samples' n-grams go into
// index 1 (shared by the siblings) or one index each.
struct Group {
  std::vector<Text> texts;
  std::vector<Index> indexes;
};

struct Sample {
  std::shared_ptr<Group> group;
  int32_t text;
  int32_t index;
};

struct Vote {
  int32_t text;
  int64_t end;
  double weight;
  int32_t match;
};

// trie.Trie, flat: children kept in insertion order as a linked list.
struct Node {
  int64_t token;
  int32_t first_child = -1, last_child = -1, next = -1;
  double weight = 0.0, mass = 0.0, reach = 0.0;
  int64_t evidence = 0;
};

class Trie {
 public:
  std::vector<Node> nodes;

  Trie() { nodes.reserve(128); nodes.push_back(Node{-1}); }

  int32_t child(int32_t parent, int64_t token) {
    for (int32_t c = nodes[parent].first_child; c >= 0; c = nodes[c].next) {
      if (nodes[c].token == token) return c;
    }
    const int32_t created = static_cast<int32_t>(nodes.size());
    nodes.push_back(Node{token});
    Node& p = nodes[parent];
    if (p.last_child < 0) {
      p.first_child = created;
    } else {
      nodes[p.last_child].next = created;
    }
    p.last_child = created;
    return created;
  }

  void insert(const Text& source, int64_t end, int64_t depth, double vote, int64_t match, int alternative_depth,
              double unknown_confidence) {
    const int64_t stop = std::min<int64_t>(end + depth, static_cast<int64_t>(source.tokens.size()));
    int32_t node = 0;
    nodes[0].reach += vote;
    double weight = vote;
    bool known = true;
    for (int64_t at = end; at < stop; ++at) {
      const int64_t token = source.tokens[at];
      double prob = source.probs[at];
      if (at - end < alternative_depth) {
        const int64_t first = source.alt_start[at];
        for (int32_t i = 0; i < source.alt_len[at]; ++i) {
          const int64_t other = source.alt_tokens[first + i];
          const double p = source.alt_probs[first + i];
          if (other == token || p <= 0.0) continue;
          Node& entry = nodes[child(node, other)];
          entry.weight += weight * p;
          entry.mass += vote * p;
          if (match > entry.evidence) entry.evidence = match;
        }
      }
      if (prob == UNKNOWN) {
        known = false;
        prob = unknown_confidence;
      } else if (known) {
        weight *= prob;
      }
      node = child(node, token);
      Node& entry = nodes[node];
      entry.weight += weight;
      entry.mass += vote * prob;
      entry.reach += vote;
      if (match > entry.evidence) entry.evidence = match;
    }
  }

  double confidence(int32_t node, int32_t parent) const {
    const double reach = nodes[parent].reach;
    return reach > 0 ? std::min(1.0, nodes[node].mass / reach) : 0.0;
  }
};

struct Frontier {
  double weight;
  int32_t node, parent, parent_node;
  // std::priority_queue pops the largest: the heaviest node, the earliest created among equals
  // (Python's heap of (-weight, node, ...) tuples).
  bool operator<(const Frontier& o) const {
    if (weight != o.weight) return weight < o.weight;
    return node > o.node;
  }
};

class SuffixStore {
 public:
  SuffixStore(int min_n, int max_n, int keep, int max_votes, int max_depth, int max_nodes, bool shared,
              bool first_only, int alternatives, double min_alternative, double length_decay,
              double unknown_confidence, int alternative_depth)
      : min_n_(min_n), max_n_(max_n), keep_(keep), max_votes_(max_votes), max_depth_(max_depth),
        max_nodes_(max_nodes), shared_(shared), first_only_(first_only), alternatives_(alternatives),
        min_alternative_(min_alternative), length_decay_(length_decay), unknown_confidence_(unknown_confidence),
        alternative_depth_(alternative_depth) {
    if (!(1 <= min_n && min_n <= max_n && max_n <= MAX_N) || keep < 1 || max_depth < 1 || max_nodes < 0) {
      throw py::value_error("the compiled suffix store needs 1 <= min_n <= max_n <= " + std::to_string(MAX_N) +
                            ", keep >= 1, max_depth >= 1 and max_nodes >= 0");
    }
  }

  void add_group(const std::vector<int64_t>& prompt, const std::vector<int64_t>& sample_ids) {
    std::vector<int64_t> taken;
    for (int64_t id : sample_ids) {
      if (samples_.count(id)) taken.push_back(id);
    }
    if (!taken.empty()) {
      std::string listed;
      for (size_t i = 0; i < taken.size(); ++i) listed += (i ? ", " : "") + std::to_string(taken[i]);
      throw py::value_error("sample ids already live: [" + listed + "]");
    }
    auto group = std::make_shared<Group>();
    group->texts.reserve(1 + sample_ids.size());
    group->texts.emplace_back();
    for (int64_t token : prompt) group->texts[0].append(token, UNKNOWN);
    group->indexes.push_back(new_index());
    group->indexes[0].add(group->texts, 0, 1);
    if (shared_) group->indexes.push_back(new_index());
    for (int64_t id : sample_ids) {
      const int32_t text = static_cast<int32_t>(group->texts.size());
      group->texts.push_back(group->texts[0]);
      int32_t index = 1;
      if (!shared_) {
        index = static_cast<int32_t>(group->indexes.size());
        group->indexes.push_back(new_index());
      }
      group->indexes[index].add(group->texts, text, static_cast<int64_t>(prompt.size()));
      samples_[id] = Sample{group, text, index};
    }
  }

  void observe(int64_t sample_id, const std::vector<int64_t>& tokens, const std::optional<std::vector<double>>& probs,
               const std::optional<std::vector<Alternative>>& alternatives) {
    auto found = samples_.find(sample_id);
    if (found == samples_.end()) throw py::key_error(std::to_string(sample_id));
    Sample& sample = found->second;
    const bool soft = alternatives.has_value() && alternatives_ > 0;
    if (probs && probs->size() != tokens.size()) {
      throw py::value_error(std::to_string(tokens.size()) + " tokens but " + std::to_string(probs->size()) +
                            " probabilities");
    }
    if (soft && alternatives->size() != tokens.size()) {
      throw py::value_error(std::to_string(tokens.size()) + " tokens but " + std::to_string(alternatives->size()) +
                            " sets of alternatives");
    }
    Group& group = *sample.group;
    Text& text = group.texts[sample.text];
    const int64_t start = static_cast<int64_t>(text.tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      text.append(tokens[i], probs ? (*probs)[i] : UNKNOWN);
      if (!soft || !(*alternatives)[i]) continue;
      // suffix._likely: the leading ones at least min_alternative likely, at most ``alternatives``.
      const auto& [others, likelihoods] = *(*alternatives)[i];
      const size_t most = std::min({static_cast<size_t>(alternatives_), likelihoods.size()});
      size_t n = 0;
      while (n < most && likelihoods[n] >= min_alternative_) ++n;
      n = std::min(n, others.size());
      text.alt_len.back() = static_cast<int32_t>(n);
      for (size_t j = 0; j < n; ++j) {
        text.alt_tokens.push_back(others[j]);
        text.alt_probs.push_back(likelihoods[j]);
      }
    }
    group.indexes[sample.index].add(group.texts, sample.text, start + 1);
  }

  void observe_many(const std::vector<int64_t>& sample_ids, const std::vector<std::vector<int64_t>>& tokens,
                    const std::vector<std::optional<std::vector<double>>>& probs,
                    const std::vector<std::optional<std::vector<Alternative>>>& alternatives) {
    if (tokens.size() != sample_ids.size() || probs.size() != sample_ids.size() ||
        alternatives.size() != sample_ids.size()) {
      throw py::value_error("observe_many needs one list of tokens, probabilities and alternatives per sample");
    }
    for (size_t i = 0; i < sample_ids.size(); ++i) observe(sample_ids[i], tokens[i], probs[i], alternatives[i]);
  }

  void remove(int64_t sample_id) {
    auto found = samples_.find(sample_id);
    if (found == samples_.end()) return;
    samples_.erase(found);  // the group goes with its last sample's shared_ptr
  }

  bool live(int64_t sample_id) const { return samples_.count(sample_id) > 0; }

  // One (tokens, parents, confidence, evidence) per sample: its ``budget`` heaviest trie nodes.
  py::list propose(const std::vector<int64_t>& sample_ids, const std::vector<int64_t>& budgets) {
    if (budgets.size() != sample_ids.size()) throw py::value_error("propose needs one budget per sample");
    for (int64_t id : sample_ids) {
      if (!samples_.count(id)) throw py::key_error(std::to_string(id));
    }
    py::list trees(sample_ids.size());
    std::vector<int64_t> tokens, evidence;
    std::vector<int32_t> parents;
    std::vector<double> confidence;
    for (size_t i = 0; i < sample_ids.size(); ++i) {
      tokens.clear(), parents.clear(), confidence.clear(), evidence.clear();
      propose_one(samples_.at(sample_ids[i]), std::max<int64_t>(0, std::min<int64_t>(budgets[i], max_nodes_)),
                  tokens, parents, confidence, evidence);
      trees[i] = py::make_tuple(py::cast(tokens), py::cast(parents), py::cast(confidence), py::cast(evidence));
    }
    return trees;
  }

 private:
  Index new_index() const { return Index{min_n_, max_n_, keep_, {}}; }

  // lookup.find_continuations: every source votes once with its longest match.
  void find_votes(const Group& group, const Sample& sample, std::vector<Vote>& votes) const {
    const std::vector<int64_t>& tokens = group.texts[sample.text].tokens;
    const int64_t length = static_cast<int64_t>(tokens.size());
    std::vector<char> voted(group.texts.size(), 0);
    const int32_t lookup[2] = {sample.index, 0};
    Key key;
    for (int64_t n = std::min<int64_t>(max_n_, length); n >= min_n_; --n) {
      key.n = static_cast<int32_t>(n);
      std::memcpy(key.t, tokens.data() + (length - n), sizeof(int64_t) * n);
      const double weight = std::pow(length_decay_, static_cast<double>(max_n_ - n));  // as Python's float ** int
      for (int32_t index : lookup) {
        auto [first, last] = group.indexes[index].recent(key);
        for (const Occurrence* at = last; at != first;) {
          --at;
          if (voted[at->text] || at->end >= static_cast<int64_t>(group.texts[at->text].tokens.size())) continue;
          votes.push_back({at->text, at->end, weight, static_cast<int32_t>(n)});
          if (first_only_ || static_cast<int64_t>(votes.size()) == max_votes_) return;
          voted[at->text] = 1;
        }
      }
    }
  }

  void propose_one(const Sample& sample, int64_t budget, std::vector<int64_t>& tokens, std::vector<int32_t>& parents,
                   std::vector<double>& confidence, std::vector<int64_t>& evidence) {
    if (budget == 0) return;
    const int64_t depth = std::min<int64_t>(max_depth_, budget);
    const Group& group = *sample.group;
    votes_.clear();
    find_votes(group, sample, votes_);
    if (votes_.empty()) return;
    Trie trie;
    for (const Vote& vote : votes_) {
      trie.insert(group.texts[vote.text], vote.end, depth, vote.weight, vote.match, alternative_depth_,
                  unknown_confidence_);
    }
    std::priority_queue<Frontier> frontier;
    for (int32_t c = trie.nodes[0].first_child; c >= 0; c = trie.nodes[c].next) {
      frontier.push({trie.nodes[c].weight, c, -1, 0});
    }
    while (!frontier.empty() && static_cast<int64_t>(tokens.size()) < budget) {
      const Frontier top = frontier.top();
      frontier.pop();
      const int32_t local = static_cast<int32_t>(tokens.size());
      tokens.push_back(trie.nodes[top.node].token);
      parents.push_back(top.parent);
      confidence.push_back(trie.confidence(top.node, top.parent_node));
      evidence.push_back(trie.nodes[top.node].evidence);
      for (int32_t c = trie.nodes[top.node].first_child; c >= 0; c = trie.nodes[c].next) {
        frontier.push({trie.nodes[c].weight, c, local, top.node});
      }
    }
  }

  int min_n_, max_n_, keep_, max_votes_, max_depth_, max_nodes_;
  bool shared_, first_only_;
  int alternatives_;
  double min_alternative_, length_decay_, unknown_confidence_;
  int alternative_depth_;
  std::unordered_map<int64_t, Sample> samples_;
  std::vector<Vote> votes_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SuffixStore>(m, "SuffixStore")
      .def(py::init<int, int, int, int, int, int, bool, bool, int, double, double, double, int>(), py::arg("min_n"),
           py::arg("max_n"), py::arg("keep"), py::arg("max_votes"), py::arg("max_depth"), py::arg("max_nodes"),
           py::arg("shared"), py::arg("first_only"), py::arg("alternatives"), py::arg("min_alternative"),
           py::arg("length_decay"), py::arg("unknown_confidence"), py::arg("alternative_depth"))
      .def("add_group", &SuffixStore::add_group)
      .def("observe", &SuffixStore::observe)
      .def("observe_many", &SuffixStore::observe_many)
      .def("remove", &SuffixStore::remove)
      .def("live", &SuffixStore::live)
      .def("propose", &SuffixStore::propose);
}
